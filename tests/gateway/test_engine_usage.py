"""What an engine reports as its usage, checked before it is billed: counts no engine can mean (negative,
fractional, past any context) bill the request by the gateway's own counts instead (real gateway, engines on
real sockets, the Redis ledger and its journal)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import orjson
import pytest

from cache.ledger import day_of
from gateway.http.answer_usage import TAIL_USAGE_BYTES
from gateway.tenancy.answer_tokens import generated_texts
from gateway.tenancy.billing import usage_is_credible
from tests.faulty_engines import Scripted, answers, chat_chunk
from tests.gateway.test_tenants_billing import PRICE, PRICES, chat
from tests.harness import MODEL, ClusterFactory

# Each an engine's usage as it writes it (raw JSON: one of them is past what a JSON encoder here writes).
MADE_UP = {
    "past_int64_costs": '{"prompt_tokens": 4611686018427387904, "completion_tokens": 1, "total_tokens": 5}',
    "past_any_context": '{"prompt_tokens": 10000000000000, "completion_tokens": 1, "total_tokens": 5}',
    "negative": '{"prompt_tokens": -5, "completion_tokens": 1, "total_tokens": -4}',
    "fractional": '{"prompt_tokens": 9, "completion_tokens": 1.5, "total_tokens": 10.5}',
    "no_prompt_count": '{"total_tokens": 7}',
    "empty": "{}",
}


def _usage_event(usage: str) -> bytes:
    head = orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL})
    return b"data: " + head[:-1] + b',"choices":[],"usage":' + usage.encode() + b"}\n\n"


ANSWER = "a whole answer of a few more words than one"


def _whole(usage: str) -> bytes:
    message = {"role": "assistant", "content": ANSWER}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    head = orjson.dumps(
        {"id": "c", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [choice]}
    )
    return head[:-1] + b',"usage":' + usage.encode() + b"}"


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("usage", list(MADE_UP.values()), ids=list(MADE_UP))
async def test_usage_an_engine_made_up_is_billed_by_the_gateways_own_counts(
    make_cluster: ClusterFactory, redis_url: str, usage: str, stream: bool
) -> None:
    if stream:
        events = [chat_chunk(role=True), chat_chunk("x"), _usage_event(usage), b"data: [DONE]\n\n"]
        engine = Scripted(events).app
    else:
        engine = answers(_whole(usage))
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/liar": engine},
        engine_options={"eu-west/liar": {"kv_events": False}},
        prices={MODEL: PRICE},
        redis_url=redis_url,
    )
    assert cluster.session is not None
    answered: list[tuple[int, bytes]] = []
    for i in range(2):  # (two: costs past 2**63 between them overflow the day's sums)
        body = chat(f"question {i}", stream=stream)
        try:
            async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
                answered.append((r.status, await r.read()))
        except aiohttp.ClientError as exc:  # (a stack trace's 500 written inside a started stream)
            answered.append((0, repr(exc).encode()))
    for status, body in answered:
        assert status == 200, body[-300:]
        assert body.endswith(b"data: [DONE]\n\n") if stream else f'"content":"{ANSWER}"'.encode() in body
    writer = cluster.gateway.billing.writer
    await writer.flush()
    assert writer.state == "ok" and writer.spooled == 0
    ledger = cluster.gateway.billing.ledger
    records = await ledger.records()
    assert len(records) == 2
    whole_tokens = len(cluster.gateway.prepare.tokenizer.encode_public(ANSWER))
    assert whole_tokens > 1
    for rec in records:
        # The engine's numbers are no counts: billed as a request that came without usage.
        assert (rec.status, rec.estimated) == ("completed", True)
        assert 0 < rec.prompt_tokens < 1000
        # A stream's tokens counted by its events; a whole answer's by tokenizing what it generated (they
        # were not counted: 0, however long the answer).
        assert rec.completion_tokens == (1 if stream else whole_tokens), (rec.completion_tokens, whole_tokens)
        assert rec.cost_picodollars == PRICES.cost_picodollars(
            rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens
        )
    today = day_of(time.time())
    [day] = await ledger.daily("default", today, today)
    assert (day.requests, day.cost_picodollars) == (2, sum(r.cost_picodollars for r in records))


def test_a_usage_is_credible_only_with_whole_token_counts_any_context_can_hold() -> None:
    good: dict[str, Any] = {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None}
    assert usage_is_credible(good)
    assert usage_is_credible({"input_tokens": 5, "output_tokens": 0, "input_tokens_details": {}})
    assert usage_is_credible({"prompt_tokens": 0, "total_tokens": 0})  # (an empty prompt, as counted)
    junk_cached = {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": "2"}}
    bad: list[dict[str, Any]] = [
        {"prompt_tokens": 10**13},
        {"prompt_tokens": 5, "completion_tokens": -1},
        {"prompt_tokens": 1.0},
        {"prompt_tokens": True},
        junk_cached,
        {"input_tokens": "5"},
        {"total_tokens": 7},
        {},
    ]
    assert [usage_is_credible(usage) for usage in bad] == [False] * len(bad)


async def test_an_internal_error_mid_stream_ends_the_stream_with_an_error_and_is_billed(
    make_cluster: ClusterFactory, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault in the gateway itself once tokens reached the client (here its crash journal refusing the
    # final record, as an overflow once did): the client's stream ends with an error event, never a 500
    # written inside the started 200, and the request is billed as failed for the usage it had.
    events = [chat_chunk(role=True), chat_chunk("x"), _usage_event('{"prompt_tokens": 9, "completion_tokens'
              '": 1, "total_tokens": 10}'), b"data: [DONE]\n\n"]  # fmt: skip
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/e": Scripted(events).app},
        engine_options={"eu-west/e": {"kv_events": False}},
        prices={MODEL: PRICE},
        redis_url=redis_url,
    )
    journal = cluster.gateway.billing.journal
    assert journal is not None and cluster.session is not None

    def refuse(record: Any) -> None:
        raise RuntimeError("the journal refuses the record")

    monkeypatch.setattr(journal, "finished", refuse)
    async with cluster.session.post(
        cluster.url + "/v1/chat/completions", json=chat("q", stream=True)
    ) as answer:
        assert answer.status == 200
        raw = await answer.read()
    assert raw.startswith(b"data: {") and b"HTTP/1.1" not in raw
    last = raw.rstrip().rsplit(b"\n\n", 1)[-1]
    assert b'"error"' in last and b"internal error" in last, raw[-300:]
    await cluster.gateway.billing.writer.flush()
    [record] = await cluster.gateway.billing.ledger.records()
    assert (record.status, record.estimated, record.prompt_tokens, record.completion_tokens) == (
        "failed",
        False,
        9,
        1,
    )


def test_the_text_a_whole_answer_generated_is_read_from_every_api_shape() -> None:
    completions = {"choices": [{"text": "one"}, {"text": "two"}]}
    chat_answer = {
        "choices": [
            {
                "message": {
                    "content": None,
                    "reasoning_content": "think",
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                }
            }
        ]
    }
    responses = {
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "why"}]},
            {"type": "message", "content": [{"type": "output_text", "text": "said"}]},
            {"type": "function_call", "name": "g", "arguments": "{}"},
        ]
    }
    assert generated_texts(completions) == ["one", "two"]
    assert generated_texts(chat_answer) == ["think", "f", '{"a": 1}']
    assert generated_texts(responses) == ["why", "said", "g", "{}"]
    assert generated_texts({"data": [{"embedding": [0.1]}]}) == []  # (embeddings generate nothing)
    assert generated_texts({"choices": "junk", "output": [3, None]}) == []


async def test_a_large_whole_answer_with_made_up_usage_is_billed_for_its_text(
    make_cluster: ClusterFactory,
) -> None:
    """An answer past TAIL_USAGE_BYTES is billed from the usage at its end without being parsed: with a
    usage that cannot bill it, its completion tokens were recorded as 0 (a small answer's text is counted)."""
    content = "word " * (TAIL_USAGE_BYTES // 5 + 1000)
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    head = orjson.dumps(
        {"id": "c", "object": "chat.completion", "created": 1, "model": MODEL, "choices": [choice]}
    )
    engine = answers(head[:-1] + b',"usage":' + MADE_UP["negative"].encode() + b"}")
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/liar": engine},
        engine_options={"eu-west/liar": {"kv_events": False}},
        prices={MODEL: PRICE},
    )
    status, _, _ = await cluster.post("/v1/chat/completions", chat("question"))
    assert status == 200
    await cluster.gateway.billing.writer.flush()
    [rec] = await cluster.gateway.billing.ledger.records()
    assert (rec.status, rec.estimated) == ("completed", True)
    assert rec.completion_tokens == len(cluster.gateway.prepare.tokenizer.encode_public(content))
