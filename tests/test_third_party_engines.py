"""The vLLM/SGLang stand-ins themselves: their HTTP shapes, prefix cache, events and both P/D protocols."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cache.chat_template import render_messages
from cache.foreign_events import ForeignRemoved, ForeignStored, decode_foreign_batch
from cache.tokens import load_tokenizer
from tests.third_party_engines import RecordingPublisher, VllmLikeEngine, vllm_block_digests, vllm_hash_id
from tests.vllm_publisher import encode_batch

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2 + "Then it rests."  # 104 bytes = 104 tokens
NULL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def complete(session: aiohttp.ClientSession, engine: VllmLikeEngine, **body: Any) -> dict[str, Any]:
    status, answer = await post(
        session, engine.url + "/v1/completions", {"model": "tiny", "max_tokens": 2, **body}
    )
    assert status == 200, answer
    return dict(answer)


async def until(predicate: Callable[[], bool], within_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def sse(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        text = (await r.read()).decode()
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_block_hashes_are_vllms_own() -> None:
    # Ids computed by vLLM 0.32.0 itself (hash_block_tokens with sha256, init_none_hash, default seed).
    salted = vllm_block_digests(list(range(64)), 32, "tenant-a")
    assert [vllm_hash_id(d) for d in salted] == [17050038076495021658, 566515669255957052]
    assert vllm_hash_id(vllm_block_digests(list(range(32)), 32)[0]) == 13907755898995373680


async def test_vllm_health_models_version_tokenize(session: aiohttp.ClientSession) -> None:
    async with VllmLikeEngine() as engine:
        async with session.get(engine.url + "/health") as r:
            assert (r.status, await r.read()) == (200, b"")
        async with session.get(engine.url + "/v1/models") as r:
            models = await r.json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
        assert models["data"][0]["owned_by"] == "vllm"
        async with session.get(engine.url + "/version") as r:
            assert (await r.json())["version"] == "0.32.0"
        status, tok = await post(session, engine.url + "/tokenize", {"model": "tiny", "prompt": "hi!"})
        assert status == 200 and tok["tokens"] == [104, 105, 33] and tok["count"] == 3
        assert tok["max_model_len"] == 2048
        messages = [{"role": "user", "content": "hi"}]
        _, tok = await post(session, engine.url + "/tokenize", {"model": "tiny", "messages": messages})
        tokenizer = load_tokenizer(None)
        assert tok["tokens"] == list(tokenizer.encode(render_messages(tokenizer, messages)))
        status, err = await post(session, engine.url + "/tokenize", {"model": "other", "prompt": "x"})
        assert status == 404 and err["error"]["type"] == "NotFoundError"


async def test_metrics_carry_the_engines_names(session: aiohttp.ClientSession) -> None:
    async with VllmLikeEngine(block_size=32, kv_capacity_blocks=64) as engine:
        await complete(session, engine, prompt=PROMPT, max_tokens=1)
        async with session.get(engine.url + "/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.value == 1.0
    assert info.labels["block_size"] == "32" and info.labels["enable_prefix_caching"] == "True"
    assert info.labels["prefix_caching_hash_algo"] == "sha256" and info.labels["engine"] == "0"
    assert info.labels["num_gpu_blocks"] == "64"
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"engine": "0", "model_name": "tiny"} and running.value == 0
    assert families["vllm:num_requests_waiting"].samples[0].value == 0
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0  # cached blocks are free blocks
    queries = families["vllm:prefix_cache_queries"].samples[0]
    assert queries.name == "vllm:prefix_cache_queries_total" and queries.value == len(PROMPT)

    async with VllmLikeEngine(kind="sglang", role="decode") as engine:
        async with session.get(engine.url + "/metrics") as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
        async with session.get(engine.url + "/health_generate") as r:
            assert (r.status, await r.read()) == (200, b"")
    sample = families["sglang:num_running_reqs"].samples[0]
    assert sample.labels == {"model_name": "tiny", "engine_type": "decode", "tp_rank": "0", "pp_rank": "0"}
    assert {"sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate"} <= set(families)


async def test_cached_tokens_on_repeats_are_whole_blocks_below_the_prompt(
    session: aiohttp.ClientSession,
) -> None:
    async with VllmLikeEngine(block_size=32) as engine:
        first = await complete(session, engine, prompt=PROMPT)
        again = await complete(session, engine, prompt=PROMPT)
        assert (cached(first), cached(again)) == (0, 96)  # 104 tokens: 3 whole blocks
        assert again["usage"]["prompt_tokens"] == 104 and again["usage"]["completion_tokens"] == 2
        # A prompt of exactly 3 blocks: its last block is never a hit (the last token is always computed).
        ids = list(range(1, 97))
        await complete(session, engine, prompt=ids)
        assert cached(await complete(session, engine, prompt=ids)) == 64
        # Token ids and text hash alike.
        assert cached(await complete(session, engine, prompt=list(PROMPT.encode()))) == 96


async def test_salt_isolates_and_reaches_the_first_blocks_event(session: aiohttp.ClientSession) -> None:
    events = RecordingPublisher()
    async with VllmLikeEngine(events=events) as engine:
        assert cached(await complete(session, engine, prompt=PROMPT, cache_salt="a")) == 0
        assert cached(await complete(session, engine, prompt=PROMPT, cache_salt="b")) == 0
        assert cached(await complete(session, engine, prompt=PROMPT)) == 0
        assert cached(await complete(session, engine, prompt=PROMPT, cache_salt="a")) == 96
        status, err = await post(
            session, engine.url + "/v1/completions", {"prompt": "x", "cache_salt": "a/b"}
        )
        assert status == 400 and err["error"]["param"] == "cache_salt"
    stored = [e for e in events.events if e["type"] == "BlockStored"]
    assert [e["extra_keys"] for e in stored] == [[["a"], None, None], [["b"], None, None], [None, None, None]]
    assert stored[0]["block_hashes"][1:] != stored[1]["block_hashes"][1:]  # the salt changes the whole chain
    assert stored[0]["parent_block_hash"] is None and stored[0]["token_ids"] == list(PROMPT.encode()[:96])
    assert list(stored[0]) == [
        *("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
        *("lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    ]


async def test_eviction_announces_tail_blocks_first(session: aiohttp.ClientSession) -> None:
    events = RecordingPublisher()
    async with VllmLikeEngine(block_size=4, kv_capacity_blocks=6, events=events) as engine:
        a, b, c = [random.Random(i).choices(range(256), k=k) for i, k in ((1, 12), (2, 12), (3, 16))]
        await complete(session, engine, prompt=a, max_tokens=1)
        await complete(session, engine, prompt=b, max_tokens=1)
        await complete(session, engine, prompt=c, max_tokens=1)
        assert cached(await complete(session, engine, prompt=b, max_tokens=1)) == 8  # its head survived
        assert len(engine.cached_hash_ids()) == 6
    stored_a, stored_b, *rest = events.batches
    step_c = rest[0]
    removed = [e["block_hashes"][0] for e in step_c if e["type"] == "BlockRemoved"]
    a_ids, b_ids = stored_a[0]["block_hashes"], stored_b[0]["block_hashes"]
    # Free blocks were used up first, then the least recently freed, each request's tail first.
    assert removed == [a_ids[2], a_ids[1], a_ids[0], b_ids[2]]
    assert step_c[-1]["type"] == "BlockStored" and len(step_c[-1]["block_hashes"]) == 4
    assert all(e == {"type": "BlockRemoved", "block_hashes": [e["block_hashes"][0]], "medium": "GPU",
                     "group_idx": 0} for e in step_c[:-1])  # fmt: skip


async def test_events_decode_with_the_gateways_reader(session: aiohttp.ClientSession) -> None:
    events = RecordingPublisher()
    async with VllmLikeEngine(block_size=4, kv_capacity_blocks=4, events=events) as engine:
        await complete(session, engine, prompt=list(range(8)), cache_salt="t", max_tokens=1)
        await complete(session, engine, prompt=list(range(100, 116)), max_tokens=1)
        assert engine.reset_prefix_cache()
    decoded = [decode_foreign_batch(encode_batch(b, 1.0, 0)).events for b in events.batches]
    first = decoded[0][0]
    assert isinstance(first, ForeignStored) and first.extra_keys == (("t",), None)
    assert first.block_hashes == tuple(vllm_hash_id(d) for d in vllm_block_digests(list(range(8)), 4, "t"))
    assert [type(e) for e in decoded[1]] == [ForeignRemoved, ForeignRemoved, ForeignStored]
    assert events.batches[-1] == [{"type": "AllBlocksCleared"}]


async def test_blocks_filled_by_generated_tokens_are_announced(session: aiohttp.ClientSession) -> None:
    events = RecordingPublisher()
    async with VllmLikeEngine(block_size=4, events=events) as engine:
        answer = await complete(session, engine, prompt=list(range(6)), max_tokens=8)
    stored = [e for batch in events.batches for e in batch]
    # Prompt block 0; then blocks 1 and 2 as decoding fills them (the last token's KV is never computed).
    assert [len(e["block_hashes"]) for e in stored] == [1, 1, 1]
    assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][0]
    generated = list(answer["choices"][0]["text"].encode())
    assert stored[1]["token_ids"] == [4, 5, *generated[:2]]


async def test_chat_ignores_token_ids_but_records_them(session: aiohttp.ClientSession) -> None:
    tokenizer = load_tokenizer(None)
    messages = [{"role": "user", "content": "hello there"}]
    expected = len(tokenizer.encode(render_messages(tokenizer, messages)))
    async with VllmLikeEngine() as engine:
        body = {"model": "tiny", "messages": messages, "max_tokens": 3, "prompt_token_ids": [1, 2, 3]}
        status, answer = await post(
            session, engine.url + "/v1/chat/completions", body, {"X-Request-Id": "r1"}
        )
        assert status == 200 and answer["usage"]["prompt_tokens"] == expected
        assert answer["id"] == "chatcmpl-r1" and answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["role"] == "assistant"
        assert answer["usage"]["prompt_tokens_details"]["created_cache_tokens"] == expected // 32 * 32
        assert engine.requests[-1].body["prompt_token_ids"] == [1, 2, 3]
        assert engine.requests[-1].request_id == "r1"
        # vLLM 0.32 does take ids forwarded in kv_transfer_params (decode-side token reuse).
        body = {**body, "kv_transfer_params": {"prompt_token_ids": [7, 8, 9, 10]}}
        status, answer = await post(session, engine.url + "/v1/chat/completions", body)
        assert status == 200 and answer["usage"]["prompt_tokens"] == 4


async def test_streams_end_with_usage_and_done(session: aiohttp.ClientSession) -> None:
    async with VllmLikeEngine() as engine:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream_options": {"include_usage": True}}
        chunks = await sse(session, engine.url + "/v1/completions", body)
        assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
        chunks = await sse(session, engine.url + "/v1/chat/completions", chat)  # no include_usage
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert len(chunks) == 3 and "usage" not in chunks[-1]
        status, err = await post(session, engine.url + "/v1/completions", {**body, "stream": False})
        assert status == 400 and err["error"]["param"] == "stream_options"


async def test_vllm_nixl_round_trip(session: aiohttp.ClientSession) -> None:
    p_events, d_events = RecordingPublisher(), RecordingPublisher()
    async with (
        VllmLikeEngine(role="prefill", events=p_events) as prefill,
        VllmLikeEngine(role="decode", events=d_events) as decode,
    ):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}
        for round_, expected_cached in ((1, 0), (2, 96)):
            rid = {"X-Request-Id": f"pd-{round_}"}
            p_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": NULL_PARAMS}
            status, p_answer = await post(session, prefill.url + "/v1/completions", p_body, rid)
            assert status == 200
            params = p_answer["kv_transfer_params"]
            assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
            assert params["remote_engine_id"] == prefill.engine_id and params["remote_host"] == "127.0.0.1"
            assert params["remote_request_id"].startswith(f"cmpl-pd-{round_}-0-")
            assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == 4
            assert params["remote_num_tokens"] == len(PROMPT)
            assert params["remote_prefill_cached_tokens"] == expected_cached == cached(p_answer)
            assert {"remote_port", "tp_size", "remote_num_tokens", "transfer_mode"} <= set(params)
            assert prefill.pool.used == 4  # held for the decode engine
            status, d_answer = await post(
                session, decode.url + "/v1/completions", {**body, "kv_transfer_params": params}, rid
            )
            assert status == 200 and d_answer["usage"]["completion_tokens"] == 5
            assert cached(d_answer) == expected_cached  # vLLM 0.32 reports the prefill's hit
            assert d_answer["kv_transfer_params"] is None
            assert prefill.pool.used == 0 and decode.pulls[-1]["ok"]
        # The decode engine cached the pulled prompt under its own hashes and announced it.
        assert d_events.batches[0][0]["block_hashes"] == p_events.batches[0][0]["block_hashes"]
        # A second read of the same transfer fails as a KV load failure: vLLM's default policy is "fail".
        status, err = await post(
            session, decode.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 500 and err["error"]["message"] == "Internal server error"
        assert not decode.pulls[-1]["ok"] and decode.pool.used == 0


async def test_vllm_prefill_lets_unread_blocks_go_after_its_lease(session: aiohttp.ClientSession) -> None:
    async with (
        VllmLikeEngine(role="prefill", kv_lease_s=0.0) as prefill,
        VllmLikeEngine(role="decode") as decode,
    ):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        p_body = {**body, "max_tokens": 1, "kv_transfer_params": NULL_PARAMS}
        _, p_answer = await post(session, prefill.url + "/v1/completions", p_body)
        assert prefill.pool.used == 4
        params = p_answer["kv_transfer_params"]
        status, _ = await post(
            session, decode.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert status == 500 and prefill.pool.used == 0


async def test_vllm_decode_without_the_prefills_hit_counts_the_whole_prompt(
    session: aiohttp.ClientSession,
) -> None:
    async with (
        VllmLikeEngine(role="prefill") as prefill,
        VllmLikeEngine(role="decode", kv_load_failure_policy="recompute") as decode,
    ):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        p_body = {**body, "max_tokens": 1, "kv_transfer_params": NULL_PARAMS}
        _, p_answer = await post(session, prefill.url + "/v1/completions", p_body)
        params = {
            k: v for k, v in p_answer["kv_transfer_params"].items() if k != "remote_prefill_cached_tokens"
        }
        _, d_answer = await post(
            session, decode.url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        assert cached(d_answer) == len(PROMPT)  # local + external: the whole prompt
        bad = {**params, "remote_engine_id": "nobody"}
        status, d_answer = await post(
            session, decode.url + "/v1/completions", {**body, "kv_transfer_params": bad}
        )
        assert status == 200 and cached(d_answer) == 96  # recomputed; its own cache holds the prompt now
        # A plain engine has no connector: it ignores the parameters.
        async with VllmLikeEngine() as plain:
            _, answer = await post(session, plain.url + "/v1/completions", p_body)
            assert answer["kv_transfer_params"] is None and plain.pool.used == 0


async def test_sglang_bootstrap_round_trip(session: aiohttp.ClientSession) -> None:
    async with (
        VllmLikeEngine(kind="sglang", role="prefill", block_size=1) as prefill,
        VllmLikeEngine(kind="sglang", role="decode", block_size=1, pd_timeout_s=0.1) as decode,
    ):
        assert prefill.bootstrap_port > 0
        messages = [{"role": "user", "content": PROMPT}]
        for expected_cached in (0, None):
            room = random.getrandbits(63)
            body = {"model": "tiny", "messages": messages, "max_tokens": 4, "bootstrap_host": "127.0.0.1",
                    "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}  # fmt: skip
            # The router sends the same body to both at once and only reads the decode's answer.
            (p_status, p_answer), (d_status, d_answer) = await asyncio.gather(
                post(session, prefill.url + "/v1/chat/completions", body),
                post(session, decode.url + "/v1/chat/completions", body),
            )
            assert (p_status, d_status) == (200, 200)
            assert p_answer["usage"]["completion_tokens"] == 1 and d_answer["usage"]["completion_tokens"] == 4
            n = d_answer["usage"]["prompt_tokens"]
            assert (
                cached(d_answer)
                == cached(p_answer)
                == (expected_cached if expected_cached is not None else n - 1)
            )
            assert "kv_transfer_params" not in d_answer
        assert decode.pool.cached == {}  # an SGLang decode keeps no radix cache by default
        # A decode whose prefill never comes gives up: an error answer.
        lonely = {**body, "bootstrap_room": 7}
        status, err = await post(session, decode.url + "/v1/chat/completions", lonely)
        assert status == 500 and err["object"] == "error" and "KVTransferError" in err["message"]
        # The prefill engine needs its bootstrap fields.
        status, err = await post(session, prefill.url + "/v1/chat/completions", {"messages": messages})
        assert status == 400 and err["message"] == "bootstrap_host is required in PREFILL mode"


async def test_sglang_prefill_that_never_answers(session: aiohttp.ClientSession) -> None:
    async with (
        VllmLikeEngine(kind="sglang", role="prefill", pd_timeout_s=0.2) as prefill,
        VllmLikeEngine(kind="sglang", role="decode", pd_timeout_s=0.2) as decode,
    ):
        prefill.hang_next()
        body = {"prompt": PROMPT, "max_tokens": 2, "bootstrap_host": "localhost",
                "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": 42}  # fmt: skip
        hung = asyncio.ensure_future(post(session, prefill.url + "/v1/completions", body))
        status, _ = await post(session, decode.url + "/v1/completions", body)
        assert status == 500 and not hung.done()
        await prefill.stop()
        with pytest.raises(aiohttp.ClientError):
            await hung


async def test_injected_failures_and_a_stop_mid_stream(session: aiohttp.ClientSession) -> None:
    async with VllmLikeEngine(decode_s_per_token=0.01) as engine:
        engine.fail_next(2, status=503)
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        statuses = [(await post(session, engine.url + "/v1/completions", body))[0] for _ in range(3)]
        assert statuses == [503, 503, 200] and len(engine.requests) == 3
        received: list[bytes] = []

        async def read_stream() -> None:
            async with session.post(engine.url + "/v1/completions", json={**body, "max_tokens": 500,
                                                                          "stream": True}) as r:  # fmt: skip
                async for chunk in r.content.iter_any():
                    received.append(chunk)

        reader = asyncio.ensure_future(read_stream())
        await until(lambda: bool(received))
        assert engine.running == 1
        await engine.stop()
        with pytest.raises(aiohttp.ClientError):
            await reader
        assert b"[DONE]" not in b"".join(received)


async def test_waits_for_blocks_when_the_cache_is_full(session: aiohttp.ClientSession) -> None:
    async with VllmLikeEngine(block_size=4, kv_capacity_blocks=4, decode_s_per_token=0.01) as engine:
        body = {"model": "tiny", "prompt": list(range(8)), "max_tokens": 9}  # 4 blocks: the whole cache
        first = asyncio.ensure_future(post(session, engine.url + "/v1/completions", body))
        second = asyncio.ensure_future(post(session, engine.url + "/v1/completions", body))
        await until(lambda: engine.waiting + engine.running == 2)
        assert (engine.running, engine.waiting) == (1, 1)
        (s1, a1), (s2, a2) = await asyncio.gather(first, second)
        # The one that waited found the other's blocks. Which one waited is the order they arrived in,
        # which two concurrent requests do not fix (on a loaded machine the second sent came first).
        assert (s1, s2) == (200, 200) and sorted((cached(a1), cached(a2))) == [0, 4]
        # max_model_len defaults to what the cache holds (16 tokens); max_tokens is clipped to what is left.
        _, answer = await post(session, engine.url + "/v1/completions", {**body, "max_tokens": 20})
        assert answer["usage"]["completion_tokens"] == 8
        status, err = await post(session, engine.url + "/v1/completions", {**body, "prompt": list(range(17))})
        assert status == 400 and "maximum context length" in err["error"]["message"]


async def test_reset_prefix_cache(session: aiohttp.ClientSession) -> None:
    events = RecordingPublisher()
    async with VllmLikeEngine(events=events) as engine:
        await complete(session, engine, prompt=PROMPT)
        async with session.post(engine.url + "/reset_prefix_cache") as r:
            assert await r.json() == {"success": True}
        assert cached(await complete(session, engine, prompt=PROMPT)) == 0
    assert events.batches[1] == [{"type": "AllBlocksCleared"}]
    async with VllmLikeEngine(kind="sglang") as engine, session.post(engine.url + "/flush_cache") as r:
        assert r.status == 200
