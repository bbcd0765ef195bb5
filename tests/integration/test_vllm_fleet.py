"""kvgate in front of two REAL vLLM 0.32.0 engines (CPU build) with KV events on, as scripts/test-vllm starts
them: 32-token blocks, 160 blocks of KV cache each (small, so that evictions happen), ZMQ events with replay.

The gateway is configured by URL, kind and event endpoints only. Every request checks that the gateway's
``x-kvgate-predicted-cached-tokens`` equals the ``cached_tokens`` vLLM reports, also after evictions and after
an engine restart (its residency must be gone, not stale).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from cache.chat_template import render_messages
from gateway.prepare import chat_dialect
from gateway.service import Gateway
from tests.integration.conftest import VllmFleet, gateway_in_front, settled, until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


class Client:
    """Sends requests through the gateway and checks each prediction against what vLLM reports."""

    def __init__(self, session: aiohttp.ClientSession, url: str, gateway: Gateway) -> None:
        self.session, self.url, self.gateway = session, url, gateway
        self.checked = 0
        self.hits = 0

    async def send(
        self, path: str, body: dict[str, Any], session_id: str | None = None
    ) -> tuple[str, str, int]:
        headers = {"x-session-affinity": session_id} if session_id else {}
        await settled(self.gateway)  # (events are asynchronous: let the last answer's blocks arrive)
        async with self.session.post(self.url + path, json={"max_tokens": 2, **body}, headers=headers) as r:
            answer = await r.json()
            assert r.status == 200, answer
            predicted = int(r.headers["x-kvgate-predicted-cached-tokens"])
            engine, route = r.headers["x-kvgate-engine"], r.headers["x-kvgate-route"]
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert predicted == cached, f"{engine} ({route}): predicted {predicted}, vLLM reported {cached}"
        self.checked += 1
        self.hits += cached > 0
        return engine, route, cached


async def test_engines_are_discovered_from_their_urls(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet) as (_, gateway):
        engines = list(gateway.fleet)
        await until(lambda: all(e.healthy for e in engines), 30, "both engines healthy")
        assert gateway.fleet.models() == [vllm_fleet.model]
        assert [e.block_size for e in engines] == [vllm_fleet.block_size] * 2
        await until(lambda: all(e.tokenizer_agrees is not None for e in engines), 30, "tokenizers checked")
        assert [e.tokenizer_agrees for e in engines] == [True, True]
        await until(lambda: all(f.ready.is_set() for f in gateway.metrics.event_followers), 30, "events")


async def test_sessions_and_shared_prefixes_land_where_their_cache_is(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = Client(session, url, gateway)
        # Conversations: each turn resends the whole history, and stays on its engine.
        homes: dict[str, str] = {}
        for turn in range(4):
            for conv in range(4):
                messages = [{"role": "system", "content": text(100 + conv, 60)}]
                for t in range(turn + 1):
                    messages += [{"role": "user", "content": text(1000 * conv + t, 25)},
                                 {"role": "assistant", "content": text(2000 * conv + t, 10)}]  # fmt: skip
                engine, route, cached = await client.send(
                    "/v1/chat/completions", {"model": "tiny", "messages": messages[:-1]}, f"conv-{conv}"
                )
                assert homes.setdefault(f"conv-{conv}", engine) == engine
                if turn:
                    assert route == "session" and cached > 0
        assert len(set(homes.values())) == 2  # the conversations spread over both engines
        # A long shared prefix without a session header: later prompts find its holder.
        for doc in range(3):
            system = text(5000 + doc, 150)
            holder, _, _ = await client.send(
                "/v1/completions", {"model": "tiny", "prompt": system + " question 0"}
            )
            for q in range(1, 4):
                engine, route, cached = await client.send(
                    "/v1/completions", {"model": "tiny", "prompt": f"{system} question {q}"}
                )
                assert (engine, route) == (holder, "prefix") and cached > 0
        assert client.checked == 28


async def test_predictions_stay_exact_through_evictions(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = Client(session, url, gateway)
        # 24 documents of ~20 blocks each: 480 blocks against 2 x 160 in the engines.
        docs = [text(9000 + d, 130) for d in range(24)]
        rng = random.Random(3)
        sent = set()
        for i in range(72):
            doc = rng.choice(docs)
            sent.add(doc)
            await client.send("/v1/completions", {"model": "tiny", "prompt": f"{doc} #{i}"})
        blocks = sum(len(gateway.prepare.tokenizer.encode(d)) // vllm_fleet.block_size for d in sent)
        assert blocks > 2 * 160, f"only {blocks} blocks sent: the engines never had to evict"
        assert client.hits >= 10
        held = sum(len(f.chain.held()) for f in gateway.metrics.event_followers if f.chain)
        assert held <= 2 * 160  # the index holds no more than the engines can: evictions were followed


async def test_client_salts_are_taken_and_predicted_exactly(vllm_fleet: VllmFleet) -> None:
    """A client's own cache_salt: joined to its tenant's, the gateway's namespace had a '/', which vLLM
    refuses (400); one with an '@' or over 128 characters was refused as it was."""
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = Client(session, url, gateway)
        for salt in ("alice", "bob@example.com", "x" * 200):
            for turn in range(2):
                _, _, cached = await client.send(
                    "/v1/completions",
                    {"model": "tiny", "prompt": text(7000, 120) + f" turn {turn}", "cache_salt": salt},
                )
                assert (cached > 0) == (turn == 1)


async def test_the_gateway_renders_chats_as_vllm_does(vllm_fleet: VllmFleet) -> None:
    """The prompt vLLM makes of a chat (its /tokenize) is the one the gateway hashes: text parts joined by
    vLLM's rule, a developer message as vLLM turns it into a system one. (Two identical requests cannot
    show this: the gateway counts what it sent as held soon, for pending_ttl_s, whatever the engine made.)"""
    async with gateway_in_front(vllm_fleet) as (_, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        parts = [{"type": "text", "text": text(7100, 40)}, {"type": "text", "text": text(7101, 20)}]
        chats = [
            [{"role": "system", "content": parts}, {"role": "user", "content": text(7102, 20)}],
            [{"role": "developer", "content": "be brief"}, {"role": "user", "content": parts}],
            [
                {"role": "system", "content": "a"},
                {"role": "user", "content": "b"},
                {"role": "developer", "content": parts},
                {"role": "user", "content": "c"},
            ],
        ]
        # Agents' chats (scripts/test-vllm serves tests/chat_templates.py's TOOLS_CHATML, which renders tools,
        # tool calls' arguments with tojson, reasoning, names and template variables): /tokenize takes tools,
        # chat_template_kwargs, add_generation_prompt and continue_final_message as a chat request does.
        # (Not the deprecated "reasoning_content" of a message: a chat request reads it as "reasoning",
        # /tokenize ignores it.)
        tools = [
            {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}},
             "x-vendor": 1},
        ]  # fmt: skip
        calls = [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{oops"}},
        ]
        history = [
            {"role": "system", "content": text(7103, 30)},
            {"role": "user", "content": "weather and time in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": calls, "reasoning": "tools first"},
            {"role": "tool", "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}],
             "tool_call_id": "c1"},
            {"role": "tool", "content": "12:00", "tool_call_id": "c2", "name": "get_time"},
            {"role": "assistant", "content": "Done.", "tool_calls": []},
            {"role": "user", "content": "thanks"},
        ]  # fmt: skip
        requests: list[dict[str, Any]] = [{"messages": m} for m in chats] + [
            {"messages": chats[0], "tools": tools},
            {"messages": history, "tools": tools},
            {"messages": history, "tools": tools[:1],
             "chat_template_kwargs": {"enable_thinking": False, "style": "terse", "unused": 1}},
            {"messages": [*chats[0], {"role": "assistant", "content": "The answer is "}],
             "add_generation_prompt": False, "continue_final_message": True},
            {"messages": chats[0], "chat_template_kwargs": {"documents": [{"title": "t", "text": "body"}]}},
        ]  # fmt: skip
        dialect = chat_dialect(gateway.fleet.serving(vllm_fleet.model))
        tokenizer = gateway.prepare.tokenizer
        for fields in requests:
            body = {"model": vllm_fleet.model, **fields}
            text_ = render_messages(
                tokenizer, fields["messages"], dialect=dialect, inputs=dialect.chat_inputs(body)
            )
            ours = [int(t) for t in tokenizer.encode(text_)]
            async with session.post(vllm_fleet.urls[0] + "/tokenize", json=body) as r:
                answer = await r.json()
            assert "tokens" in answer, (fields, answer)
            assert ours == answer["tokens"], (fields, tokenizer.decode(answer["tokens"]), text_)


async def test_a_restarted_engine_has_no_stale_residency(vllm_fleet: VllmFleet) -> None:
    if vllm_fleet.restart is None:
        pytest.skip("no restart script (run scripts/test-vllm)")
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = Client(session, url, gateway)
        prompt = text(77, 200)
        body = {"model": "tiny", "prompt": prompt}
        engine, _, _ = await client.send("/v1/completions", body)
        again, route, cached = await client.send("/v1/completions", body)
        assert (again, route) == (engine, "prefix") and cached > 0
        index = int(engine.rsplit("v", 1)[1])
        restart = await asyncio.create_subprocess_exec(str(vllm_fleet.restart), str(index))
        assert await restart.wait() == 0
        state = gateway.fleet.engines[engine]
        await until(lambda: state.healthy, 60, "the restarted engine healthy again")
        # Until the follower has seen the restart, the gateway may still believe the old cache: the first
        # batch after the restart (or the idle probe's replay, within 10 s) tells it.
        follower = next(f for f in gateway.metrics.event_followers if f.engine.id == engine)
        await until(lambda: follower.restarts >= 1 or follower.resyncs >= 2, 30, "the restart seen in events")
        tokens = gateway.prepare.tokenizer.encode(prompt)
        chain = gateway.prepare.block_hashes(tokens, vllm_fleet.model, block_size=vllm_fleet.block_size)
        assert gateway.state.lookup(chain).get(engine, 0) == 0
        for _ in range(3):  # wherever they go now, the predictions hold
            await client.send("/v1/completions", body)


async def test_a_prompt_cache_key_keeps_a_conversation_on_its_engine(vllm_fleet: VllmFleet) -> None:
    # OpenAI's prompt_cache_key (the SDK's prompt_cache_key=) names the session where no header does; vLLM
    # takes the field and ignores it.
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = Client(session, url, gateway)
        homes: dict[int, str] = {}
        for turn in range(3):
            for conv in range(4):
                messages = [{"role": "system", "content": text(300 + conv, 60)}]
                messages += [{"role": "user", "content": text(3000 * conv + t, 25)} for t in range(turn + 1)]
                body = {"model": "tiny", "messages": messages, "prompt_cache_key": f"agent {conv}"}
                engine, route, cached = await client.send("/v1/chat/completions", body)
                assert homes.setdefault(conv, engine) == engine
                if turn:
                    assert route == "session" and cached > 0
        assert len(set(homes.values())) == 2 and client.checked == 12
