"""Faults: engines that hang, fail, die or flood, a client that reads slowly, Redis going away, shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from cache.redis_keys import RedisKeys
from cache.residency_redis import RedisResidencyIndex
from cache.sessions_redis import RedisSessionStore
from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.redis_connection import REDIS_TIMEOUT_S
from region_map.breaker import BreakerState
from tests.faulty_engines import (
    Busy,
    EndsAfterDone,
    Firehose,
    Scripted,
    answers,
    black_hole,
    chat_chunk,
    server_error,
    stalls_after,
    usage_of,
)
from tests.harness import MODEL, ClusterFactory, _start
from tests.redis_prefixes import new_prefix
from tests.redis_process import RedisProcess


def chat(content: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": content}], **extra}


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str, str]:
    async with session.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        return r.status, (await r.read()).decode(), r.headers.get("x-kvgate-engine", "")


# -- engines that misbehave while their /health looks fine ------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_an_engine_that_sends_nothing_is_timed_out_and_failed_over(
    make_cluster: ClusterFactory, stream: bool
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/hole": black_hole()},
        engine_options={"eu-west/hole": {"kv_events": False}},
        routing={"policy": "round_robin"},
        resilience={"first_byte_timeout_s": 0.3, "s_per_output_token": 0.0, "breaker_failures": 2},
    )
    assert cluster.session is not None
    hole = cluster.gateway.fleet.engines["eu-west/hole"]
    started = time.monotonic()
    for i in range(8):
        if stream:
            status, text, engine = await stream_text(cluster.session, cluster.url, chat(f"q{i}"))
            assert status == 200 and text.endswith("data: [DONE]\n\n")
        else:
            status, body, headers = await cluster.post("/v1/chat/completions", chat(f"q{i}"))
            assert status == 200 and body["usage"]["completion_tokens"] > 0
            engine = headers["x-kvgate-engine"]
        assert engine == "eu-west/e0"  # every answer came from the engine that answers
    # Two timeouts opened the hole's breaker: the other requests never waited on it.
    assert hole.breaker.state is BreakerState.OPEN
    assert time.monotonic() - started < 8 * 0.3


async def test_a_5xx_before_any_byte_is_retried_on_another_engine(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/bad": server_error(500)},
        engine_options={"eu-west/bad": {"kv_events": False}},
        routing={"policy": "round_robin"},
    )
    answers = [await cluster.post("/v1/chat/completions", chat(f"q{i}")) for i in range(6)]
    assert [status for status, _, _ in answers] == [200] * 6
    assert cluster.gateway.fleet.engines["eu-west/bad"].breaker.state is BreakerState.OPEN
    assert any(h["x-kvgate-route"] == "failover" for _, _, h in answers)


async def test_a_request_every_engine_fails_gets_the_last_error(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/bad": server_error(500)},
        engine_options={"eu-west/bad": {"kv_events": False}},
    )
    status, body, _ = await cluster.post("/v1/chat/completions", chat())
    assert status == 502 and "engine exploded" in body["error"]["message"]


async def test_the_last_failed_attempt_is_answered_without_a_pause_before_it(
    make_cluster: ClusterFactory,
) -> None:
    # The pause between attempts spaces out retries; after the last attempt nothing is retried, so the
    # client must not wait for it. A pause of 30 s (and up to 45 with its jitter) makes one plain to see.
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/bad": server_error(500)},
        engine_options={"eu-west/bad": {"kv_events": False}},
        resilience={"max_attempts": 1, "retry_backoff_s": 30.0},
    )
    status, body, _ = await asyncio.wait_for(cluster.post("/v1/chat/completions", chat()), timeout=10)
    assert status == 502 and "engine exploded" in body["error"]["message"]


@pytest.mark.parametrize(
    ("status", "message_chars", "client_status"),
    [(500, 5_000_000, 502), (400, 5_000_000, 400), (400, 40_000, 400), (503, 40_000, 502)],
)
async def test_a_huge_error_from_an_engine_reaches_the_client_and_the_log_cut(
    make_cluster: ClusterFactory,
    caplog: pytest.LogCaptureFixture,
    status: int,
    message_chars: int,
    client_status: int,
) -> None:
    # Multi-megabyte error messages (an engine echoing a prompt, a foreign server on its port) were read
    # whole and copied into the client's error and the log line.
    huge = orjson.dumps({"error": {"message": "x" * message_chars, "type": "BadRequestError", "param": None,
                                   "code": 400}})  # fmt: skip
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/bad": answers(huge, status=status)},
        engine_options={"eu-west/bad": {"kv_events": False}},
        resilience={"max_attempts": 1},
    )
    got, body, _ = await cluster.post("/v1/chat/completions", chat())
    assert got == client_status, body
    message = body["error"]["message"]
    assert 200 < len(message) < 4096 and "[cut: " in message, message[:300]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert all(len(r.getMessage()) < 8192 for r in caplog.records)


@pytest.mark.parametrize("status", [429, 503])
async def test_an_engine_that_says_it_is_busy_is_failed_over_and_left_alone_for_its_retry_after(
    make_cluster: ClusterFactory, status: int
) -> None:
    # An engine too busy for a request (an OpenAI upstream's 429, a server's 503) answers before any token:
    # another engine can take the request, and the engine asked for none for Retry-After seconds.
    busy = Busy(status, retry_after="30")
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/busy": busy.app},
        engine_options={"eu-west/busy": {"kv_events": False}},
        routing={"policy": "round_robin"},
    )
    answers = []
    for i in range(6):
        answers.append(
            await cluster.post("/v1/chat/completions", chat(f"q{i}"), headers={"x-session-affinity": "s"})
        )
    assert [(s, h["x-kvgate-engine"]) for s, _, h in answers] == [(200, "eu-west/e0")] * 6
    assert busy.requests == 1, "Retry-After: 30 was not honoured"
    engine = cluster.gateway.fleet.engines["eu-west/busy"]
    assert (engine.inflight, engine.prefill.tokens) == (0, 0)
    binding = cluster.gateway.state.sessions.get_now("default", "s")
    assert binding is not None and binding.engine == "eu-west/e0"


@pytest.mark.parametrize(
    ("status", "retry_after", "whole", "ms"),
    [
        (429, "7", "7", "7000"),
        (503, "7", "7", "7000"),
        (429, "6.5", "7", "6500"),  # the engine's wait passed through: rounded up, and exact in ms
        (503, "6.5", "7", "6500"),
        (429, None, "1", "1000"),  # the engine named no wait: the gateway's default
        # A date whose year no datetime holds names none either (an OverflowError: a 500 and a traceback)
        (429, "Mon, 01 Jan 99999999999999999999 00:00:00 GMT", "1", "1000"),
    ],
)
async def test_a_request_every_engine_is_too_busy_for_gets_503_with_their_retry_after(
    make_cluster: ClusterFactory, status: int, retry_after: str | None, whole: str, ms: str
) -> None:
    busy = Busy(status, retry_after=retry_after)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/busy": busy.app},
        engine_options={"eu-west/busy": {"kv_events": False}},
    )
    status_out, body, headers = await cluster.post("/v1/chat/completions", chat())
    assert (status_out, body["error"]["code"]) == (503, "engines_overloaded")
    assert (headers.get("Retry-After"), headers.get("retry-after-ms")) == (whole, ms)
    assert busy.requests == 1
    assert await cluster.gateway.billing.ledger.records() == []  # the engine took nothing: nothing billed


@pytest.mark.parametrize(
    ("retry_after", "resilience", "whole", "ms"),
    [
        ("86400", {}, "60", "60000"),  # a day: the gateway holds the engine out for its 60 s at most
        ("120", {}, "60", "60000"),
        ("86400", {"breaker_max_cooldown_s": 20.0}, "20", "20000"),
        ("Fri, 31 Dec 9999 23:59:59 GMT", {}, "60", "60000"),
    ],
)
async def test_an_engine_wait_past_the_gateways_hold_is_told_as_the_hold(
    make_cluster: ClusterFactory, retry_after: str, resilience: dict[str, Any], whole: str, ms: str
) -> None:
    # The gateway routes to the engine again after breaker_max_cooldown_s whatever it asked: a client told a
    # day would stay away a day (and the OpenAI SDK ignores a retry-after-ms over 60 s for its own backoff).
    busy = Busy(429, retry_after=retry_after)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/busy": busy.app},
        engine_options={"eu-west/busy": {"kv_events": False}},
        resilience=resilience,
    )
    status_out, body, headers = await cluster.post("/v1/chat/completions", chat())
    assert (status_out, body["error"]["code"]) == (503, "engines_overloaded")
    assert (headers.get("Retry-After"), headers.get("retry-after-ms")) == (whole, ms)


@pytest.mark.parametrize("soon_first", [True, False])
async def test_a_request_every_engine_is_too_busy_for_is_told_the_soonest_wait(
    make_cluster: ClusterFactory, soon_first: bool
) -> None:
    # Two engines refuse, one for 5 s and one for 30 s: the gateway has room again in 5 s, whichever refused
    # last (the client was told the last one's wait).
    waits = ["5", "30"] if soon_first else ["30", "5"]
    engines = {f"eu-west/busy{i}": Busy(503, retry_after=wait) for i, wait in enumerate(waits)}
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={name: engine.app for name, engine in engines.items()},
        engine_options={name: {"kv_events": False} for name in engines},
    )
    status_out, body, headers = await cluster.post("/v1/chat/completions", chat())
    assert (status_out, body["error"]["code"]) == (503, "engines_overloaded")
    assert [engine.requests for engine in engines.values()] == [1, 1]
    assert (headers.get("Retry-After"), headers.get("retry-after-ms")) == ("5", "5000")
    # The next request finds both held out (no engine tried): it is told when the first is back, not 1 s,
    # which had a client (the SDK: 2 retries) retry into the same refusal and give up meanwhile.
    status_out, body, headers = await cluster.post("/v1/chat/completions", chat())
    assert (status_out, body["error"]["code"]) == (503, "no_engine_available")
    assert [engine.requests for engine in engines.values()] == [1, 1]
    assert 4000 < int(headers["retry-after-ms"]) <= 5000 and headers["Retry-After"] == "5"


async def test_a_request_an_engine_refuses_leaves_no_session_binding_or_residency_there(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: Any
) -> None:
    # An engine's own 4xx (a prompt over its context, say) reaches the client as it is; the engine computed
    # nothing of the prompt, so no gateway may count it as cached there, nor bind the session to it.
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/refuses": server_error(400)},
        engine_options={"eu-west/refuses": {"kv_events": False}},
        redis_url=redis_url,
        redis_prefix=redis_keys.prefix,
    )
    status, body, _ = await cluster.post(
        "/v1/chat/completions", chat("a long prompt " * 40), headers={"x-session-affinity": "s"}
    )
    assert status == 400 and body["error"]["message"] == "engine exploded"
    state = cluster.gateway.state
    await state.writer.flush()
    assert state.redis_index is not None
    assert (await state.index.holdings("eu-west/refuses")).approximate == {}
    assert (await state.redis_index.holdings("eu-west/refuses")).approximate == {}
    assert state.sessions.get_now("default", "s") is None
    assert await state.redis_sessions.get("default", "s") is None  # type: ignore[union-attr]


async def test_admission_refuses_at_once_when_every_engine_is_full(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(
        {"eu-west": 1},
        sim={"decode_s_per_token": 0.05},
        resilience={"max_inflight_per_engine": 2},
    )
    assert cluster.session is not None

    async def one() -> tuple[int, float, str | None, str | None]:
        start = time.monotonic()
        status, _, headers = await cluster.post("/v1/chat/completions", chat(max_tokens=20))
        return status, time.monotonic() - start, headers.get("Retry-After"), headers.get("retry-after-ms")

    results = await asyncio.gather(*(one() for _ in range(5)))
    assert sorted(s for s, _, _, _ in results) == [200, 200, 503, 503, 503]
    refused = [r for r in results if r[0] == 503]
    # (the others take ~1 s)
    assert all(elapsed < 0.5 and (retry, ms) == ("1", "1000") for _, elapsed, retry, ms in refused)


# -- engines whose HTTP is fine and whose stream is not ---------------------------------------------------


async def _scripted_cluster(make_cluster: ClusterFactory, engine: Scripted) -> Any:
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/scripted": engine.app},
        engine_options={"eu-west/scripted": {"kv_events": False}},
        prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}},
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    return cluster, client


async def _stream_until_the_sdk_raises(client: openai.AsyncOpenAI) -> tuple[list[str], openai.APIError]:
    """Stream a chat completion with the SDK; the texts it gave before it raised, and what it raised."""
    texts: list[str] = []
    with pytest.raises(openai.APIError) as raised:
        async for chunk in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        ):
            texts.append(chunk.choices[0].delta.content or "")
    await client.close()
    return texts, raised.value


async def _one_record(cluster: Any) -> Any:
    """The request's one ledger record, once the relay made it (the client may have its answer first)."""
    ledger = cluster.gateway.billing.ledger
    await cluster.wait_for(lambda: len(ledger._records) >= 1)
    await asyncio.sleep(0.1)  # ... and no second one follows
    [record] = await ledger.records()
    return record


def _usage_records(cluster: Any, outcome: str) -> float:
    return sum(
        s.value
        for m in cluster.gateway.metrics.usage_records.collect()
        for s in m.samples
        if s.name.endswith("_total") and s.labels["outcome"] == outcome
    )


async def test_an_error_event_the_engine_sends_mid_stream_is_an_error_to_the_sdk_and_billed_as_failed(
    make_cluster: ClusterFactory,
) -> None:
    # vLLM and SGLang end a stream whose generation failed with {"error": {...}} and then [DONE]. The SDK
    # raises on that event; the ledger and the metrics must say the stream failed, not that it completed,
    # and bill the tokens it carried (the error event carries none).
    error = {"message": "engine out of memory", "type": "InternalServerError", "param": None, "code": 500}
    events = [chat_chunk(role=True), *(chat_chunk("x") for _ in range(3))]
    engine = Scripted([*events, b"data: " + orjson.dumps({"error": error}) + b"\n\n", b"data: [DONE]\n\n"])
    cluster, client = await _scripted_cluster(make_cluster, engine)
    texts, raised = await _stream_until_the_sdk_raises(client)
    assert "".join(texts) == "xxx" and raised.message == "engine out of memory"
    record = await _one_record(cluster)
    assert (record.status, record.estimated, record.completion_tokens) == ("failed", True, 3)
    assert _usage_records(cluster, "failed") == 1 and _usage_records(cluster, "completed") == 0


async def test_a_stream_the_engine_ends_without_done_is_an_error_to_the_sdk_not_a_short_answer(
    make_cluster: ClusterFactory,
) -> None:
    # An engine whose handler returned mid-answer ends its HTTP response cleanly, without finish_reason, usage
    # or [DONE]. The SDK ends a stream quietly at EOF: relayed as it is, a truncated answer looks complete.
    engine = Scripted([chat_chunk(role=True), chat_chunk("x"), chat_chunk("x")])
    cluster, client = await _scripted_cluster(make_cluster, engine)
    texts, raised = await _stream_until_the_sdk_raises(client)
    assert "".join(texts) == "xx" and "[DONE]" in raised.message
    assert isinstance(raised.body, dict) and raised.body["code"] == "upstream_error"
    record = await _one_record(cluster)
    assert (record.status, record.estimated, record.completion_tokens) == ("failed", True, 2)


async def test_a_stream_whose_engine_keeps_its_response_open_after_done_ends_for_the_client_at_done(
    make_cluster: ClusterFactory,
) -> None:
    # An engine (or a proxy in front of it) that sends [DONE] and then holds its response open: a client
    # reading to the end of the response (curl, httpx) waited out the stall timeout, and the ledger record
    # waited with it. [DONE] ends the stream.
    usage = usage_of(5, 2)
    events = [chat_chunk(role=True), chat_chunk("x"), chat_chunk("x", finish="stop"), chat_chunk(usage=usage)]
    engine = Scripted([*events, b"data: [DONE]\n\n", b": never sent\n\n"], pause_at=len(events) + 1)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/scripted": engine.app},
        engine_options={"eu-west/scripted": {"kv_events": False}},
        resilience={"stall_timeout_s": 60},
    )
    assert cluster.session is not None
    async with asyncio.timeout(5):  # (the stall timeout is 60 s)
        status, text, _ = await stream_text(cluster.session, cluster.url, chat())
        record = await _one_record(cluster)
    assert status == 200 and text.endswith("data: [DONE]\n\n") and text.count('"content":"x"') == 2
    assert (record.status, record.estimated, record.completion_tokens) == ("completed", False, 2)
    engine.resume.set()


async def test_what_an_engine_sends_after_done_is_not_relayed_and_the_answer_is_billed_as_completed(
    make_cluster: ClusterFactory,
) -> None:
    # An engine that writes more after its [DONE] (an error event, then 2 MB of tokens: more than the
    # gateway buffers, so its connection is dropped after the grace). The client's answer was whole at
    # [DONE]: what came with it in the same read was relayed after it, and the late error made the ledger
    # say failed while the SDK had the whole answer.
    usage = usage_of(5, 2)
    events = [chat_chunk(role=True), chat_chunk("x"), chat_chunk("x", finish="stop"), chat_chunk(usage=usage)]
    late = b'data: {"error":{"message":"late","type":"InternalServerError"}}\n\n'
    late += chat_chunk("y") * (2 * 1024 * 1024 // len(chat_chunk("y")))
    engine = Scripted([*events, b"data: [DONE]\n\n" + late])
    cluster, client = await _scripted_cluster(make_cluster, engine)
    texts = [
        chunk.choices[0].delta.content or ""
        async for chunk in await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True
        )
        if chunk.choices
    ]
    await client.close()
    assert "".join(texts) == "xx"
    record = await _one_record(cluster)
    assert (record.status, record.estimated, record.completion_tokens) == ("completed", False, 2)
    # A client that reads the response to its end gets nothing after [DONE] either.
    assert cluster.session is not None
    status, text, _ = await stream_text(cluster.session, cluster.url, chat())
    assert status == 200 and text.endswith("data: [DONE]\n\n") and '"y"' not in text and "late" not in text


async def test_an_engine_that_ends_its_response_just_after_done_keeps_its_pooled_connection(
    make_cluster: ClusterFactory,
) -> None:
    # An engine's HTTP response ends a moment after its [DONE] (the chunked body's terminator, written
    # separately). Aborting the exchange at [DONE] lost that keep-alive connection, and every streamed
    # request opened a new one; the gateway waits a short grace for the response's end instead.
    engine = EndsAfterDone(end_after_s=0.01)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/late": engine.app},
        engine_options={"eu-west/late": {"kv_events": False}},
    )
    assert cluster.session is not None
    for i in range(5):
        status, text, _ = await stream_text(cluster.session, cluster.url, chat())
        assert status == 200 and text.endswith("data: [DONE]\n\n")
        await cluster.wait_for(lambda n=i + 1: engine.finished == n)  # (a client is rarely back in 10 ms)
        await asyncio.sleep(0.02)  # ... and the response's end reached the gateway
    assert len(engine.peers) == 5 and len(set(engine.peers)) == 1, engine.peers
    assert cluster.gateway.clients.pool(cluster.engines["eu-west/late"][1]).open_connections == 1


@pytest.mark.parametrize("client_leaves", [False, True])
async def test_an_engine_that_never_ends_its_response_after_done_is_disconnected_after_the_grace(
    make_cluster: ClusterFactory, client_leaves: bool
) -> None:
    # The grace after [DONE] is bounded: an engine that holds its response open is disconnected once it is
    # up, whether the client reads its answer to the end or leaves as soon as it has seen [DONE].
    engine = EndsAfterDone(end_after_s=None)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/open": engine.app},
        engine_options={"eu-west/open": {"kv_events": False}},
        resilience={"stall_timeout_s": 60},
    )
    assert cluster.session is not None
    async with asyncio.timeout(5):  # (the stall timeout is 60 s)
        async with cluster.session.post(cluster.url + "/v1/chat/completions", json=chat(stream=True)) as r:
            if client_leaves:
                seen = b""
                while b"[DONE]" not in seen:
                    seen += await r.content.readany()
                r.close()  # drops the client's connection
            else:
                assert (await r.read()).endswith(b"data: [DONE]\n\n")
        await cluster.wait_for(lambda: engine.dropped == 1, within_s=1)
        record = await _one_record(cluster)
    assert record.status == "completed" and record.completion_tokens == 2
    assert cluster.gateway.clients.pool(cluster.engines["eu-west/open"][1]).open_connections == 0


async def test_a_stream_that_ends_without_done_after_its_usage_is_billed_as_failed_as_the_client_was_told(
    make_cluster: ClusterFactory,
) -> None:
    # The usage chunk came, then the engine ended its response without [DONE]: the client gets an error
    # event (the stream failed), so the ledger must say failed too, billing the tokens the usage reports.
    usage = usage_of(5, 2)
    engine = Scripted([chat_chunk(role=True), chat_chunk("x"), chat_chunk("x"), chat_chunk(usage=usage)])
    cluster, client = await _scripted_cluster(make_cluster, engine)
    texts, raised = await _stream_until_the_sdk_raises(client)
    assert "".join(texts) == "xx" and "[DONE]" in raised.message
    record = await _one_record(cluster)
    assert (record.status, record.estimated, record.completion_tokens) == ("failed", False, 2)
    assert _usage_records(cluster, "failed") == 1 and _usage_records(cluster, "completed") == 0


async def test_a_stream_the_engine_ends_empty_is_failed_over_before_the_client_sees_it(
    make_cluster: ClusterFactory,
) -> None:
    # A 200 whose body ends with no event at all: nothing reached the client, so another engine answers,
    # instead of an empty stream that the SDK takes for an answer with no text.
    empty = Scripted([])
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/empty": empty.app},
        engine_options={"eu-west/empty": {"kv_events": False}},
        routing={"policy": "round_robin"},
    )
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    for i in range(4):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"q{i}"}], max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in raw.parse() if c.choices])
        assert text and raw.headers["x-kvgate-engine"] == "eu-west/e0"
    await client.close()
    assert empty.bodies  # (it was asked, and failed over)
    await cluster.gateway.billing.writer.flush()
    records = await cluster.gateway.billing.ledger.records()
    assert [(r.engine, r.status) for r in records] == [("eu-west/e0", "completed")] * 4


@pytest.mark.parametrize(
    "body", [b"<html><body>502 Bad Gateway</body></html>", b'{"id": "chatcmpl-1", "choices": [{"mess', b"[]"]
)
async def test_a_whole_answer_that_is_no_json_object_is_failed_over_not_handed_to_the_sdk(
    make_cluster: ClusterFactory, body: bytes
) -> None:
    # A 200 whose body is no completion (a proxy's page, a cut body): the SDK would fail to parse it with
    # a JSONDecodeError of its own. Nothing reached the client yet, so another engine answers; with no
    # other engine, the client gets an OpenAI-shaped 502.
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/bad": answers(body)},
        engine_options={"eu-west/bad": {"kv_events": False}},
        routing={"policy": "round_robin"},
    )
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "hello"}]
    for _ in range(3):
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL, messages=hello, max_tokens=3
        )
        assert raw.parse().choices[0].message.content and raw.headers["x-kvgate-engine"] == "eu-west/e0"
    await cluster.stop_engine("eu-west/e0")
    cluster.gateway.fleet.engines["eu-west/e0"].mark_failure("stopped", unhealthy_after=1)
    with pytest.raises(openai.InternalServerError) as raised:
        await client.chat.completions.create(model=MODEL, messages=hello, max_tokens=3)
    await client.close()
    assert raised.value.status_code == 502 and raised.value.code == "upstream_error"
    assert "eu-west/bad" in raised.value.message


# -- a client that reads slowly --------------------------------------------------------------------------


async def test_a_slow_reader_holds_back_the_engine_instead_of_filling_the_gateway(
    make_cluster: ClusterFactory,
) -> None:
    hose = Firehose()
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/hose": hose.app},
        engine_options={"eu-west/hose": {"kv_events": False}},
    )
    host, port = cluster.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)  # a small window, as a slow phone has
    sock.connect((host, int(port)))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock, limit=16 * 1024)
    body = orjson.dumps(chat(stream=True, max_tokens=100_000))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = len(await reader.readexactly(64 * 1024))
    await asyncio.sleep(1.0)
    stalled_at = hose.written
    await asyncio.sleep(0.5)
    # The engine could write gigabytes a second; it is held back by the client's pace instead. What is
    # in flight is bounded by socket buffers on both legs, not by the length of the answer.
    assert hose.written == stalled_at
    assert hose.written - received < 24 << 20
    for _ in range(50):
        received += len(await reader.read(64 * 1024))
    assert hose.written > stalled_at  # reading again lets the engine go on
    writer.close()


# -- engines dying under load ----------------------------------------------------------------------------


def _sim_engines(count: int) -> list[EngineProcess]:
    engines = []
    for i in range(count):
        port = free_port()
        cmd = [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL,
               "--engine-id", f"eu-west/e{i}", "--decode-s-per-token", "0.004",
               "--prefill-s-per-token", "0"]  # fmt: skip
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engines.append(EngineProcess("eu-west", f"e{i}", port, process))
    return engines


async def _gateway_before(
    engines: list[EngineProcess], gateway: dict[str, Any]
) -> tuple[web.Application, web.AppRunner, str]:
    """A gateway in this process in front of ``engines`` (region eu-west): its app, runner and URL."""
    config = parse_config(
        {
            "region": "eu-west",
            "regions": [
                {
                    "name": "eu-west",
                    "engines": [{"name": e.name, "url": e.url, "model": MODEL} for e in engines],
                }
            ],
            "gateway": gateway,
        }
    )
    app = build_app(config)
    runner, url = await _start(app)
    return app, runner, url


async def test_kill_9_of_an_engine_loses_no_request_that_had_not_started_streaming() -> None:
    engines = _sim_engines(4)
    try:
        await wait_healthy(engines)
        app, runner, url = await _gateway_before(
            engines, {"health_interval_s": 0.1, "routing": {"policy": "least_load"}}
        )
        victim = engines[1]
        outcomes: list[tuple[bool, int, bool, str]] = []  # (stream, status, completed, engine)
        queue = list(range(300))

        async def worker(session: aiohttp.ClientSession) -> None:
            while queue:
                i = queue.pop(0)
                if i == 100:
                    os.kill(victim.process.pid, signal.SIGKILL)
                body = chat(f"request {i} " * 20, max_tokens=25)
                if i % 2:
                    status, text, engine = await stream_text(session, url, body)
                    outcomes.append((True, status, text.endswith("data: [DONE]\n\n"), engine))
                else:
                    async with session.post(url + "/v1/chat/completions", json=body) as r:
                        data = await r.json(content_type=None)
                        done = r.status == 200 and data["usage"]["completion_tokens"] == 25
                        outcomes.append((False, r.status, done, r.headers.get("x-kvgate-engine", "")))

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(worker(session) for _ in range(16)))
        records = await app[GATEWAY].billing.ledger.records()
        await runner.cleanup()
    finally:
        stop_engines(engines)
    assert len(outcomes) == 300
    broken = [o for o in outcomes if not o[2]]
    # Only streams that were already flowing from the killed engine may end early (with an error event);
    # everything else, including every non-streaming request, was answered in full by another engine.
    assert all(
        stream and status == 200 and engine == f"eu-west/{victim.name}"
        for stream, status, _, engine in broken
    ), broken  # (stream, status, completed, engine) of each
    assert len(broken) <= 16, broken
    # Every request was billed once; the broken streams for what they had received.
    assert len(records) == 300 and len({r.record_id for r in records}) == 300
    failed = [r for r in records if r.status == "failed"]
    assert len(failed) == len(broken), (failed, broken)
    # By the gateway's own count when the engine died before its usage event; by the engine's usage (all 25
    # tokens) when that event got out just before the kill and only the stream's end was lost.
    assert all((r.estimated and r.completion_tokens < 25) or r.completion_tokens == 25 for r in failed), (
        failed
    )
    assert sum(1 for o in outcomes if o[3] == f"eu-west/{victim.name}") > len(
        broken
    )  # it served before dying


# -- engines that freeze ---------------------------------------------------------------------------------


async def test_a_stream_whose_engine_falls_silent_ends_at_the_stall_deadline_billed_for_what_it_sent(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/stuck": stalls_after(tokens=3)},
        engine_options={"eu-west/stuck": {"kv_events": False}},
        resilience={"stall_timeout_s": 0.5},
        prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}},
    )
    assert cluster.session is not None
    async with asyncio.timeout(10):  # (the engine-silence timeout is 600 s)
        status, text, _ = await stream_text(cluster.session, cluster.url, chat(max_tokens=50))
    assert status == 200 and text.count('"content":"x"') == 3
    assert text.rstrip().endswith("}") and "upstream_error" in text.splitlines()[-2]  # an error event ends it
    await cluster.gateway.billing.writer.flush()
    [rec] = await cluster.gateway.billing.ledger.records()
    assert rec.status == "failed" and rec.completion_tokens == 3 and rec.cost_picodollars > 0


async def test_a_frozen_engine_fails_its_requests_over_as_soon_as_it_is_declared_unhealthy() -> None:
    """SIGSTOP of an engine process: its silent requests do not wait out the first-byte (30 s) and engine
    silence (600 s) timeouts; a waiting answer is served by another engine, a running stream ends."""
    engines = _sim_engines(2)
    frozen: EngineProcess | None = None
    try:
        await wait_healthy(engines)
        _, runner, url = await _gateway_before(
            engines, {"health_interval_s": 0.1, "health_timeout_s": 0.3, "unhealthy_after": 2}
        )
        async with aiohttp.ClientSession() as session:
            session_header = {"x-session-affinity": "conversation-1"}
            body = {**chat("a long story", max_tokens=100_000), "stream": True}
            stream = await session.post(url + "/v1/chat/completions", json=body, headers=session_header)
            await stream.content.readany()
            frozen = next(e for e in engines if f"eu-west/{e.name}" == stream.headers["x-kvgate-engine"])
            os.kill(frozen.process.pid, signal.SIGSTOP)
            started = time.monotonic()
            # The session still points at the frozen engine, which has not missed a health check yet.
            async with asyncio.timeout(10):
                async with session.post(
                    url + "/v1/chat/completions", json=chat("next turn", max_tokens=5), headers=session_header
                ) as r:
                    answer = await r.json()
                    assert r.status == 200 and answer["usage"]["completion_tokens"] == 5
                    assert r.headers["x-kvgate-engine"] != stream.headers["x-kvgate-engine"]
                rest = (await stream.content.read()).decode()
            assert time.monotonic() - started < 8
            assert '"upstream_error"' in rest and "[DONE]" not in rest  # the stream ended with an error event
            stream.close()
        await runner.cleanup()
    finally:
        if frozen is not None:
            os.kill(frozen.process.pid, signal.SIGCONT)
        stop_engines(engines)


# -- Redis away ------------------------------------------------------------------------------------------


async def test_redis_outage_keeps_serving_and_redis_is_rebuilt_when_it_returns(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    cluster = await make_cluster({"eu-west": 2}, redis_url=private_redis.url)
    state = cluster.gateway.state
    state.writer.probe_interval_s = 0.1
    status, _, _ = await cluster.post(
        "/v1/chat/completions", chat("before"), headers={"x-session-affinity": "s1"}
    )
    assert status == 200
    private_redis.stop()
    # New sessions, never seen: no waiting on the missing Redis. A request that waited on the Redis client
    # (its connect, reply and pool timeouts, REDIS_TIMEOUT_S) would take that long; the request path bounds
    # its own reads (the session lookup, the claim) far below it. (The bound is not a speed goal: a request
    # here takes ~10 ms, and a loaded CI machine once took 0.38 s for the first one.)
    for i in range(5):
        start = time.monotonic()
        status, _, headers = await cluster.post(
            "/v1/chat/completions", chat(f"during {i} " * 30), headers={"x-session-affinity": f"outage-{i}"}
        )
        assert status == 200 and time.monotonic() - start < REDIS_TIMEOUT_S
    await cluster.wait_for(lambda: state.writer.failing, within_s=5)
    during_engine = headers["x-kvgate-engine"]
    private_redis.start()
    await cluster.wait_for(lambda: not state.writer.failing and not len(state.writer), within_s=10)
    await state.writer.flush()
    client = aioredis.from_url(private_redis.url)
    sessions = RedisSessionStore(client, RedisKeys(cluster.redis_prefix))
    binding = await sessions.get("default", "outage-4")
    assert binding is not None and binding.engine == during_engine  # written while Redis was away
    held = await RedisResidencyIndex(client, RedisKeys(cluster.redis_prefix)).holdings(during_engine)
    assert held.exact == (await state.index.holdings(during_engine)).exact and held.exact
    await client.aclose()


# -- shutdown --------------------------------------------------------------------------------------------


def test_graceful_shutdown_drains_open_streams_and_flushes_the_ledger(tmp_path: Path, redis_url: str) -> None:
    [engine] = _sim_engines(1)
    prefix = new_prefix()
    port = free_port()
    try:
        asyncio.run(wait_healthy([engine]))
        config = tmp_path / "deploy.toml"
        config.write_text(
            f'region = "eu-west"\n[[regions]]\nname = "eu-west"\n'
            f'engines = [{{ name = "e0", url = "{engine.url}", model = "{MODEL}" }}]\n'
            f'[gateway]\nport = {port}\nredis_url = "{redis_url}"\nredis_prefix = "{prefix}"\n'
            f'spool_path = "{tmp_path / "spool"}"\n'
        )
        gateway = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
            stderr=subprocess.DEVNULL,
        )
        try:
            asyncio.run(_drain_while_streaming(port, gateway))
            assert gateway.wait(15) == 0
        finally:
            if gateway.poll() is None:
                gateway.kill()
    finally:
        stop_engines([engine])

    async def records() -> int:
        client = aioredis.from_url(redis_url)
        try:
            return int(await client.xlen(f"{{{prefix}:ledger}}:stream"))
        finally:
            async for key in client.scan_iter(match=f"*{prefix}*"):
                await client.delete(key)
            await client.aclose()

    assert asyncio.run(records()) == 1  # the drained stream was billed before the gateway exited


async def _drain_while_streaming(port: int, gateway: subprocess.Popen[bytes]) -> None:
    url = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session:
        for _ in range(100):
            try:
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
        body = chat("a long answer please", max_tokens=400, stream=True)  # 400 x 4 ms: 1.6 s
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            first = await r.content.readline()
            assert first.startswith(b"data:")
            gateway.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            with pytest.raises(aiohttp.ClientError):  # no longer accepting
                async with aiohttp.ClientSession() as other, other.get(url + "/health") as _:
                    pass
            rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n")  # the open stream ran to its end
