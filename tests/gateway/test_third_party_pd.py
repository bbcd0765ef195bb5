"""P/D with stock engines, in their own protocols: vLLM's NixlConnector flow and SGLang's bootstrap rooms.

The engines are tests/third_party_engines.py's stand-ins, which speak both protocols as the real engines'
source does (the real vLLM P/D pair cannot run on these machines: see the issue's note).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import ThirdPartyFleet as Fleet
from tests.gateway.test_trace_context import PARENT as TRACEPARENT
from tests.third_party_engines import Received, VllmLikeEngine

MODEL = "tiny"  # the stand-ins' model
LONG = "You are a careful assistant. " * 40  # ~1,100 byte tokens: well past local_prefill_max_tokens


def chats(engine: VllmLikeEngine) -> list[Received]:
    """What the engine was sent on its chat endpoint (the gateway also asks its /tokenize)."""
    return [r for r in engine.requests if r.path == "/v1/chat/completions"]


def chat(question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": LONG}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}


@pytest.mark.parametrize("stream", [False, True])
async def test_vllm_pd_prefills_with_one_token_then_decodes_with_the_returned_params(
    third_party: Fleet, stream: bool
) -> None:
    cluster, engines = await third_party({"eu-west/p": {"role": "prefill"}, "eu-west/d": {"role": "decode"}})
    prefill, decode = engines["eu-west/p"], engines["eu-west/d"]
    trace = {"traceparent": TRACEPARENT}
    async with cluster.session.post(
        cluster.url + "/v1/chat/completions", json=chat("hi", stream=stream), headers=trace
    ) as r:  # type: ignore[union-attr]
        assert r.status == 200, await r.text()
        await r.read()
        assert r.headers["x-kvgate-prefill"] == "remote"
        assert (r.headers["x-kvgate-prefill-engine"], r.headers["x-kvgate-decode-engine"]) == (
            "eu-west/p",
            "eu-west/d",
        )
    [first] = chats(prefill)
    assert (
        first.body["max_tokens"] == 1 and first.body["stream"] is False and "stream_options" not in first.body
    )
    assert first.body["kv_transfer_params"]["do_remote_decode"] is True
    [second] = chats(decode)
    params = second.body["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == prefill.engine_id
    assert second.body["max_tokens"] == 4 and second.body.get("stream", False) is stream
    assert first.request_id == second.request_id  # one X-Request-Id for both halves
    assert first.headers["traceparent"] == second.headers["traceparent"] == TRACEPARENT  # one trace too
    assert len(decode.pulls) == 1


async def test_vllm_pd_predicts_the_prefill_engines_cache_hit(third_party: Fleet) -> None:
    cluster, _ = await third_party({"eu-west/p": {"role": "prefill"}, "eu-west/d": {"role": "decode"}})
    cached = []
    for _ in range(3):
        status, answer, headers = await cluster.post("/v1/chat/completions", chat("the same question"))
        assert status == 200, answer
        reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        cached.append((int(headers["x-kvgate-predicted-cached-tokens"]), reported))
    assert cached[0] == (0, 0)
    assert cached[-1][1] > 0 and cached[-1][0] == cached[-1][1]


async def test_a_failed_vllm_prefill_falls_back_to_a_local_prefill_on_the_decode_engine(
    third_party: Fleet,
) -> None:
    cluster, engines = await third_party({"eu-west/p": {"role": "prefill"}, "eu-west/d": {"role": "decode"}})
    engines["eu-west/p"].fail_next(1, status=500)
    status, answer, headers = await cluster.post("/v1/chat/completions", chat("hi"))
    assert status == 200, answer
    assert headers["x-kvgate-prefill"] == "local" and headers["x-kvgate-engine"] == "eu-west/d"
    assert "kv_transfer_params" not in chats(engines["eu-west/d"])[-1].body


@pytest.mark.parametrize("stream", [False, True])
async def test_sglang_pd_sends_one_body_with_a_bootstrap_room_to_both(
    third_party: Fleet, stream: bool
) -> None:
    cluster, engines = await third_party(
        {"eu-west/p": {"role": "prefill", "kind": "sglang", "block_size": 1, "kv_capacity_blocks": 4096},
         "eu-west/d": {"role": "decode", "kind": "sglang", "block_size": 1, "kv_capacity_blocks": 4096}}
    )  # fmt: skip
    prefill, decode = engines["eu-west/p"], engines["eu-west/d"]
    trace = {"traceparent": TRACEPARENT}
    async with cluster.session.post(
        cluster.url + "/v1/chat/completions", json=chat("hi", stream=stream), headers=trace
    ) as r:  # type: ignore[union-attr]
        assert r.status == 200, await r.text()
        data = await r.read()
        assert r.headers["x-kvgate-engine"] == "eu-west/d" and data.count(b"chatcmpl") >= 1
    await cluster.wait_for(lambda: len(chats(prefill)) == 1)
    [p], [d] = chats(prefill), chats(decode)
    assert p.body == d.body and p.headers["traceparent"] == d.headers["traceparent"] == TRACEPARENT
    assert (d.body["bootstrap_host"], d.body["bootstrap_port"]) == ("127.0.0.1", prefill.bootstrap_port)
    assert 0 <= d.body["bootstrap_room"] < 2**63


async def test_an_sglang_decode_engine_is_never_sent_a_request_without_a_prefill(third_party: Fleet) -> None:
    cluster, engines = await third_party(
        {"eu-west/p": {"role": "prefill", "kind": "sglang", "block_size": 1, "kv_capacity_blocks": 4096},
         "eu-west/d": {"role": "decode", "kind": "sglang", "block_size": 1, "kv_capacity_blocks": 4096}}
    )  # fmt: skip
    short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer, _ = await cluster.post(
        "/v1/chat/completions", short
    )  # short: a kvgate engine prefills it
    assert status == 200, answer
    assert "bootstrap_room" in chats(engines["eu-west/d"])[-1].body


async def test_a_silent_vllm_prefill_is_given_up_after_one_tokens_allowance_not_the_whole_answers(
    third_party: Fleet,
) -> None:
    # The prefill half asks for one token: a prefill engine that never answers is given up after the
    # first-byte timeout and one token's allowance, not after the client's whole output budget
    # (here 30 x 10 s), and the decode engine prefills locally instead.
    cluster, engines = await third_party(
        {"eu-west/p": {"role": "prefill"}, "eu-west/d": {"role": "decode"}},
        resilience={"first_byte_timeout_s": 0.5, "s_per_output_token": 10.0},
    )
    engines["eu-west/p"].hang_next(1)
    body = chat("hi", max_tokens=30)
    async with asyncio.timeout(20):  # the whole budget would be 300.5 s
        status, answer, headers = await cluster.post("/v1/chat/completions", body)
    assert status == 200, answer
    assert headers["x-kvgate-prefill"] == "local" and headers["x-kvgate-engine"] == "eu-west/d"
    assert len(chats(engines["eu-west/p"])) == 1  # it was asked, and never answered


async def test_a_vllm_prefill_queued_past_the_first_byte_limit_is_awaited_not_given_up(
    third_party: Fleet,
) -> None:
    # A prefill engine that prefills one prompt at a time (~0.6 s each) and answers its one-token half
    # whole, as vLLM does; a first-byte limit shorter than the queue the third of three prompts waits in.
    # Before, that prompt's prefill was given up after the limit and recomputed on the decode engine.
    per_token = 0.002
    cluster, engines = await third_party(
        {"eu-west/p": {"role": "prefill", "prefill_s_per_token": per_token, "prefill_slots": 1},
         "eu-west/d": {"role": "decode"}},
        routing={"prefill_s_per_token": per_token},
        resilience={"first_byte_timeout_s": 0.3, "s_per_output_token": 0.0, "max_attempts": 1},
    )  # fmt: skip

    async def one(i: int) -> tuple[int, str, str]:
        await asyncio.sleep(0.1 * i)  # (sent in order: the engine queues them as the gateway counted them)
        # ~300 byte tokens of its own, past the decode engine's local_prefill_max_tokens (256).
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"q{i} " * 75}]}
        status, answer, headers = await cluster.post("/v1/chat/completions", body)
        return status, headers.get("x-kvgate-prefill", ""), answer

    answers = await asyncio.gather(*(one(i) for i in range(3)))
    assert [(status, where) for status, where, _ in answers] == [(200, "remote")] * 3, answers
    assert len(chats(engines["eu-west/p"])) == 3
    assert cluster.gateway.fleet.engines["eu-west/p"].breaker.state.name == "CLOSED"
