"""The simulated engine over real HTTP: OpenAI shapes, prefix caching, errors, disconnects, queueing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from cache.chat_template import render_chat
from cache.events import decode_snapshot
from cache.hashing import block_hashes, namespace_seed
from cache.tokens import ByteTokenizer
from tests.chat_templates import TOOLS_CHATML
from tests.engine.sim_nodes import BS, StartSim, text_of, wait_for
from tests.models import make_tokenizer_dir


def assert_usage(usage: dict[str, Any], prompt: int, completion: int, cached: int) -> None:
    assert usage == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ------------------------------------------------------------------------------------------ shapes


async def test_completion_non_streaming(start_sim: StartSim) -> None:
    sim = await start_sim()
    body = await sim.complete({"model": "kvgate-sim", "prompt": "Hello there", "max_tokens": 12})
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "kvgate-sim"
    assert abs(body["created"] - time.time()) < 60
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert isinstance(choice["text"], str) and len(choice["text"].encode()) == 12
    assert choice["text"].isascii()
    assert_usage(body["usage"], prompt=11, completion=12, cached=0)


async def test_chat_non_streaming(start_sim: StartSim) -> None:
    sim = await start_sim()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    body = await sim.chat({"model": "kvgate-sim", "messages": messages, "max_completion_tokens": 7})
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"]) == 7
    assert choice["finish_reason"] == "length"
    prompt_tokens = len(render_chat(messages).encode())
    assert_usage(body["usage"], prompt=prompt_tokens, completion=7, cached=0)


async def test_default_max_tokens_is_16(start_sim: StartSim) -> None:
    sim = await start_sim()
    body = await sim.complete({"prompt": "x"})
    assert body["usage"]["completion_tokens"] == 16
    # A chat too: the pseudo-text never ends on its own, so filling the context would stream for minutes.
    chat = await sim.chat({"messages": [{"role": "user", "content": "x"}]})
    assert chat["usage"]["completion_tokens"] == 16


async def test_completion_streaming(start_sim: StartSim) -> None:
    sim = await start_sim()
    request = {"prompt": "Stream me", "max_tokens": 9, "seed": 7}
    plain = await sim.complete(request)
    events = await sim.stream("/v1/completions", {**request, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    token_chunks, final, usage_chunk = chunks[:-2], chunks[-2], chunks[-1]
    assert len(token_chunks) == 9  # one chunk per token
    for c in chunks:
        assert c["object"] == "text_completion" and c["id"].startswith("cmpl-") and c["model"] == "kvgate-sim"
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks)
    text = "".join(c["choices"][0]["text"] for c in token_chunks)
    assert text == plain["choices"][0]["text"]  # same seed, same answer
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["text"] == ""
    assert usage_chunk["choices"] == []
    assert_usage(usage_chunk["usage"], prompt=9, completion=9, cached=0)


async def test_chat_streaming(start_sim: StartSim) -> None:
    sim = await start_sim()
    events = await sim.stream(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-2])
    assert len(content) == 5
    assert sum(1 for c in chunks[1:-2] if c["choices"][0]["delta"].get("content")) == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_streaming_without_include_usage_has_no_usage_chunk(start_sim: StartSim) -> None:
    sim = await start_sim(decode_s_per_token=0.001)  # the paced path, one write per token
    events = await sim.stream("/v1/completions", {"prompt": "abc", "max_tokens": 4})
    assert events[-1] == "[DONE]"
    assert all("usage" not in c for c in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert len(events) == 4 + 1 + 1


async def test_stop_string_cuts_the_answer(start_sim: StartSim) -> None:
    sim = await start_sim()
    request = {"prompt": "Tell me", "max_tokens": 40, "seed": 3}
    full = (await sim.complete(request))["choices"][0]["text"]
    stop = full[10:13]
    cut = full[: full.find(stop)]
    body = await sim.complete({**request, "stop": [stop, "\u00e9\u00e9"]})
    assert body["choices"][0] == {"index": 0, "text": cut, "logprobs": None, "finish_reason": "stop"}
    assert body["usage"]["completion_tokens"] == len(cut)
    events = await sim.stream("/v1/completions", {**request, "stop": stop})
    assert "".join(c["choices"][0]["text"] for c in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


async def test_models_health_and_request_id(start_sim: StartSim) -> None:
    sim = await start_sim(capacity_blocks=100, max_running=3)
    async with sim.session.get(f"{sim.url}/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list"
    [entry] = models["data"]
    assert entry["id"] == "kvgate-sim" and entry["object"] == "model" and entry["owned_by"] == "kvgate"
    assert isinstance(entry["created"], int)

    assert await sim.health() == {
        "status": "ok",
        "engine_id": "sim-test",
        "role": "both",
        "model": "kvgate-sim",
        "block_size": BS,
        "kv_events": True,
        "kv_pull": True,
        "token_ids_hex": True,
        "simulated": True,
        "load": {
            "running": 0,
            "waiting": 0,
            "waiting_tokens": 0,
            "max_running": 3,
            "kv_blocks_used": 0,
            "kv_blocks_free": 100,
            "kv_blocks_total": 100,
        },
    }
    _, _, resp = await sim.post(
        "/v1/completions", {"prompt": text_of(40)}, headers={"x-request-id": "req-42"}
    )
    assert resp.headers["x-request-id"] == "req-42"
    _, _, resp = await sim.post("/v1/completions", {"prompt": "x"})
    assert len(resp.headers["x-request-id"]) >= 16
    # Prompt + answer: 40 + 16 bytes = 3 full blocks, then 1 + 16 = 1 more.
    load = (await sim.health())["load"]
    assert (load["kv_blocks_used"], load["kv_blocks_free"]) == (4, 96)


async def test_unknown_routes_methods_and_models_get_openai_errors_as_from_kvgates_engine(
    start_sim: StartSim,
) -> None:
    # aiohttp's text/plain "404: Not Found" and "405: Method Not Allowed" reached SDKs and routers as a
    # body they could not read, and GET /v1/models/{model} (the SDK's models.retrieve) had no route.
    sim = await start_sim()
    async with sim.session.get(f"{sim.url}/v2/nothing") as resp:
        assert (resp.status, resp.content_type) == (404, "application/json")
        assert (await resp.json())["error"]["code"] == "not_found"
    async with sim.session.get(f"{sim.url}/v1/completions") as resp:
        assert (resp.status, resp.content_type, resp.headers["allow"]) == (405, "application/json", "POST")
        assert (await resp.json())["error"]["code"] == "method_not_allowed"
    async with sim.session.get(f"{sim.url}/v1/models/kvgate-sim") as resp:
        card = await resp.json()
        assert resp.status == 200 and (card["id"], card["object"]) == ("kvgate-sim", "model"), card
    async with sim.session.get(f"{sim.url}/v1/models/gpt-17") as resp:
        error = (await resp.json())["error"]
        assert resp.status == 404 and (error["code"], error["param"]) == ("model_not_found", "model")
    async with sim.session.get(f"{sim.url}/v1/kv_events?after=-1") as resp:
        assert resp.status == 400  # the KV event feed's own errors are kept, as on kvgate's engine


# ---------------------------------------------------------------------------------- prefix caching


async def test_shared_prefix_reports_cached_tokens(start_sim: StartSim) -> None:
    sim = await start_sim()
    prefix = text_of(3 * BS)
    first = await sim.complete({"prompt": prefix + "first tail, not shared", "max_tokens": 4})
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    second = await sim.complete({"prompt": prefix + "SECOND tail, different", "max_tokens": 4})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS
    assert second["usage"]["prompt_tokens"] == 3 * BS + len("SECOND tail, different")


async def test_chat_second_turn_hits_the_first_turn(start_sim: StartSim) -> None:
    sim = await start_sim()
    turn1 = [
        {"role": "system", "content": "You are a helpful assistant who answers in full sentences."},
        {"role": "user", "content": "What is a KV cache and why would a gateway care where it lives?"},
    ]
    first = await sim.chat({"messages": turn1, "max_tokens": 50})
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]
    second = await sim.chat({"messages": turn2, "max_tokens": 5})
    first_prompt_tokens = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (first_prompt_tokens // BS) * BS
    # The answer's blocks were stored too: the whole first turn up to the answer's last full block hits.
    assert cached == ((first_prompt_tokens + len(answer)) // BS) * BS


async def test_prompt_token_ids_are_used_as_given(start_sim: StartSim) -> None:
    sim = await start_sim()
    text = text_of(40)
    ids = ByteTokenizer().encode(text).tolist()
    body = await sim.complete({"prompt": "this text is ignored", "prompt_token_ids": ids, "max_tokens": 2})
    assert body["usage"]["prompt_tokens"] == 40
    # Their blocks were hashed as given: the same tokens sent as text hit them.
    again = await sim.complete({"prompt": text, "max_tokens": 2})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS
    chat = await sim.chat({"prompt_token_ids": ids, "max_tokens": 2})
    assert chat["usage"]["prompt_tokens"] == 40
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 2 * BS


async def test_cache_salt_separates_namespaces(start_sim: StartSim) -> None:
    sim = await start_sim()
    prompt = text_of(4 * BS + 1)
    a = await sim.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    b = await sim.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"})
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    unsalted = await sim.complete({"prompt": prompt, "max_tokens": 1})
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    a2 = await sim.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    assert a2["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BS


async def test_the_last_prompt_token_is_always_computed(start_sim: StartSim) -> None:
    # As kvgate's engine, vLLM and SGLang report it: a prompt of whole blocks finds one block less cached.
    sim = await start_sim()
    prompt = text_of(4 * BS)
    await sim.complete({"prompt": prompt, "max_tokens": 1})
    again = await sim.complete({"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BS


async def test_kv_events_name_the_prompt_blocks(start_sim: StartSim) -> None:
    sim = await start_sim()
    prompt = text_of(2 * BS + 5)
    await sim.complete({"prompt": prompt, "max_tokens": 1, "cache_salt": "s"})
    expected = block_hashes(ByteTokenizer().encode(prompt), BS, namespace_seed("kvgate-sim", "s"))
    async with sim.session.get(f"{sim.url}/v1/kv_snapshot") as resp:
        snap = decode_snapshot(await resp.read())
    assert snap.engine == "sim-test" and snap.block_size == BS
    assert set(expected) <= set(snap.block_hashes)
    assert snap.seq == sim.engine.publisher.seq >= 1


async def test_a_small_cache_evicts_and_stays_consistent(start_sim: StartSim) -> None:
    sim = await start_sim(capacity_blocks=4)
    for i in range(6):
        await sim.complete({"prompt": text_of(3 * BS, salt=str(i)), "max_tokens": 1})
    assert sim.engine.cache.used == 4
    assert set(sim.engine.publisher.snapshot().block_hashes) == set(sim.engine.cache.lru_order())


# ------------------------------------------------------------------------------------------- errors


USER_X = {"role": "user", "content": "x"}
BAD_REQUESTS: list[tuple[str, bytes | dict[str, Any], int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": 12}, 400, "prompt"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "cache_salt": 1}, 400, "cache_salt"),
    ("/v1/completions", {"prompt_token_ids": [1, -2]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": [1, "a"]}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt_token_ids": "abc"}, 400, "prompt_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [USER_X], "n": 3}, 400, "n"),
    ("/v1/chat/completions", {"messages": [USER_X], "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
async def test_bad_requests_get_openai_errors(
    start_sim: StartSim, path: str, body: bytes | dict[str, Any], status: int, param: str | None
) -> None:
    sim = await start_sim()
    got_status, payload, resp = await sim.post(path, body)
    assert got_status == status
    assert resp.content_type == "application/json"
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    assert "x-request-id" in resp.headers
    assert (await sim.health())["load"]["running"] == 0


async def test_unknown_model_is_404(start_sim: StartSim) -> None:
    sim = await start_sim()
    status, payload, _ = await sim.post("/v1/chat/completions", {"model": "gpt-9", "messages": []})
    assert status == 404
    assert payload["error"]["code"] == "model_not_found"
    assert payload["error"]["param"] == "model"


# ---------------------------------------------------------------------------- load and disconnects


async def test_client_disconnect_mid_stream_frees_the_slot(start_sim: StartSim) -> None:
    sim = await start_sim(decode_s_per_token=0.05)
    prompt = text_of(3 * BS)
    resp = await sim.session.post(
        f"{sim.url}/v1/completions", data=orjson.dumps({"prompt": prompt, "max_tokens": 200, "stream": True})
    )
    assert resp.status == 200
    assert resp.headers["x-request-id"]
    line = await resp.content.readline()
    assert line.startswith(b"data: ")
    assert (await sim.health())["load"]["running"] == 1
    assert sim.engine.cache.pinned == 3
    resp.close()  # drops the connection mid-stream

    async def idle() -> bool:
        return bool((await sim.health())["load"]["running"] == 0)

    await wait_for(idle, within=2.0)
    assert sim.engine.cache.pinned == 0


async def test_client_disconnect_while_waiting_leaves_the_queue(start_sim: StartSim) -> None:
    sim = await start_sim(max_running=1, decode_s_per_token=0.02)
    busy = asyncio.create_task(sim.complete({"prompt": "first", "max_tokens": 15}))

    async def running() -> bool:
        return bool((await sim.health())["load"]["running"] == 1)

    await wait_for(running)
    waiter = asyncio.create_task(sim.complete({"prompt": "second", "max_tokens": 1}))

    async def queued() -> bool:
        return bool((await sim.health())["load"]["waiting"] == 1)

    await wait_for(queued)
    waiter.cancel()  # the client gives up while queued

    async def left() -> bool:
        return bool((await sim.health())["load"]["waiting"] == 0)

    await wait_for(left)
    assert (await sim.health())["load"]["waiting_tokens"] == 0
    await busy
    health = await sim.health()
    assert (health["load"]["running"], health["load"]["waiting"]) == (0, 0)


async def test_requests_queue_behind_max_running(start_sim: StartSim) -> None:
    sim = await start_sim(max_running=1, decode_s_per_token=0.02)
    first = asyncio.create_task(sim.complete({"prompt": "first request", "max_tokens": 12}))

    async def running() -> bool:
        return bool((await sim.health())["load"]["running"] == 1)

    await wait_for(running)
    second_prompt = text_of(37)
    second = asyncio.create_task(sim.complete({"prompt": second_prompt, "max_tokens": 2}))

    async def queued() -> bool:
        load = (await sim.health())["load"]
        return bool(load["waiting"] == 1)

    await wait_for(queued)
    load = (await sim.health())["load"]
    assert (load["running"], load["waiting"], load["waiting_tokens"]) == (1, 1, 37)
    bodies = await asyncio.gather(first, second)
    assert [b["usage"]["completion_tokens"] for b in bodies] == [12, 2]
    load = (await sim.health())["load"]
    assert (load["running"], load["waiting"], load["waiting_tokens"]) == (0, 0, 0)


async def test_a_queued_prompt_counts_only_the_prefill_past_its_cached_prefix(start_sim: StartSim) -> None:
    # waiting_tokens is the prefill still to compute (as the batching mode and kvgate's engine report it):
    # a queued turn whose earlier turn is cached has only its new tail to prefill. Counted whole, a busy
    # engine holding a conversation looked loaded by every prefix it had cached, and lost its sessions.
    sim = await start_sim(max_running=1, decode_s_per_token=0.02)
    prompt = text_of(6 * BS)
    await sim.complete({"prompt": prompt, "max_tokens": 1})  # cached now
    first = asyncio.create_task(sim.complete({"prompt": "first request", "max_tokens": 12}))

    async def running() -> bool:
        return bool((await sim.health())["load"]["running"] == 1)

    await wait_for(running)
    second = asyncio.create_task(sim.complete({"prompt": prompt + "abc", "max_tokens": 1}))

    async def queued() -> bool:
        return bool((await sim.health())["load"]["waiting"] == 1)

    await wait_for(queued)
    assert (await sim.health())["load"]["waiting_tokens"] == 3 + len(prompt) - 6 * BS
    bodies = await asyncio.gather(first, second)
    assert bodies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
    assert (await sim.health())["load"]["waiting_tokens"] == 0


async def test_costs_are_paid(start_sim: StartSim) -> None:
    sim = await start_sim(prefill_s_per_token=0.002, decode_s_per_token=0.01)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await sim.complete({"prompt": text_of(50), "max_tokens": 10})
    assert loop.time() - t0 >= 50 * 0.002 + 10 * 0.01 - 0.01
    # A cached prefix is not prefilled again.
    t0 = loop.time()
    body = await sim.complete({"prompt": text_of(50), "max_tokens": 1})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert loop.time() - t0 < 50 * 0.002


async def test_zero_cost_answers_quickly(start_sim: StartSim) -> None:
    sim = await start_sim()
    loop = asyncio.get_running_loop()
    await sim.complete({"prompt": "warm up", "max_tokens": 16})
    n = 200
    t0 = loop.time()
    for i in range(n):
        await sim.complete({"prompt": f"request {i} " + text_of(100), "max_tokens": 16})
    per_request = (loop.time() - t0) / n
    assert per_request < 0.01, f"{per_request * 1e3:.2f} ms per request"


async def test_tokenize_renders_a_chat_with_its_template_inputs_as_the_chat_endpoint_does(
    start_sim: StartSim, tmp_path: Path
) -> None:
    # vllm-router asks /tokenize for every chat: its ids must be the prompt the chat endpoint makes, with the
    # template's inputs (chat_template_kwargs, documents, ...) too; it rendered the messages alone.
    directory = make_tokenizer_dir(tmp_path / "m")
    config = {"chat_template": TOOLS_CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(orjson.dumps(config).decode())
    sim = await start_sim(tokenizer=str(directory))
    inputs = {"enable_thinking": False, "style": "terse"}
    body = {"model": sim.engine.config.model, "messages": [{"role": "user", "content": "weather?"}],
            "chat_template_kwargs": inputs, "max_tokens": 1}  # fmt: skip
    status, tokenized, _ = await sim.post("/tokenize", body)
    assert status == 200
    status, answer, _ = await sim.post("/v1/chat/completions", body)
    assert status == 200, answer
    assert answer["usage"]["prompt_tokens"] == tokenized["count"]
    plain = (await sim.post("/tokenize", {**body, "chat_template_kwargs": None}))[1]
    assert tokenized["count"] > plain["count"]  # the template's inputs are in the prompt
