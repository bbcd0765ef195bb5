"""Tenants, keys, rate limits and billing through a running gateway (simulated engines, real Redis)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import openai
import pytest
import redis.asyncio as aioredis

from cache.ledger import Prices, day_of
from cache.ledger_redis import RedisLedger
from cache.redis_keys import RedisKeys
from gateway.prepare import _cache_salt
from gateway.schemas import parse_completion
from gateway.tenancy.billing import reset_duration, usage_counts
from gateway.tenancy.tenants import FileKeyStore, Tenant, create_key, digest, tenant_from_config
from tests.conftest import ThirdPartyFleet
from tests.faulty_engines import Scripted, answers, chat_chunk, cut_stream, usage_of
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.redis_process import RedisProcess

PRICE = {"input": "0.50", "cached_input": "0.05", "output": "1.50"}
PRICES = Prices(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"))
TENANTS = {"acme": {"admin": True}, "globex": {}, "tiny": {"requests_per_minute": 2}}
LONG = "You are the support assistant of a large company; answer briefly, politely and correctly. " * 8


def chat(content: str, *, system: str = LONG, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": content}]
    return {"model": MODEL, "max_tokens": 4, "messages": messages, **extra}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def billed_cluster(make_cluster: ClusterFactory, **gateway: Any) -> tuple[Cluster, dict[str, str]]:
    cluster = await make_cluster(
        {"eu-west": 1},
        auth={"enabled": True},
        tenants=TENANTS,
        prices={MODEL: PRICE},
        **gateway,
    )
    store = cluster.gateway.billing.keys
    keys = {tenant: (await create_key(store, tenant))[0] for tenant in TENANTS}
    return cluster, keys


def cost_of(usage: dict[str, Any]) -> int:
    return PRICES.cost_picodollars(*usage_counts(usage))


def kvgate(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, check=check
    )


# -- keys -----------------------------------------------------------------------------------------------


async def test_requests_need_a_valid_key(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    for headers in ({}, bearer("kvg-not-a-key-at-all-0000"), {"Authorization": f"Basic {keys['acme']}"}):
        status, body, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=headers)
        assert status == 401
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "invalid_api_key"
        assert keys["acme"] not in body["error"]["message"]
    status, body, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer(keys["acme"]))
    assert status == 200 and body["usage"]["cost"] == pytest.approx(cost_of(body["usage"]) / 10**12)


async def test_the_openai_sdk_gets_its_authentication_error(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    bad = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="kvg-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.chat.completions.create(**chat("hi"))
    good = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=keys["globex"], max_retries=0)
    answer = await good.chat.completions.create(**chat("hi"))
    assert answer.usage is not None and answer.usage.prompt_tokens > 0
    await bad.close()
    await good.close()


async def test_keys_are_stored_only_as_hashes(
    make_cluster: ClusterFactory, redis_url: str, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    where = ["--redis", redis_url, "--redis-prefix", redis_keys.prefix]
    key = (await asyncio.to_thread(kvgate, "keys", "create", "--tenant", "acme", *where)).stdout.strip()
    assert key.startswith("kvg-") and len(key) > 30
    stored = [
        (k, await redis_client.dump(k)) async for k in redis_client.scan_iter(match=f"{redis_keys.prefix}:*")
    ]
    assert stored and all(key.encode() not in (k + (v or b"")) for k, v in stored)
    cluster = await make_cluster(
        {"eu-west": 1}, auth={"enabled": True}, redis_url=redis_url, redis_prefix=redis_keys.prefix
    )
    status, _, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer(key))
    assert status == 200
    listed = await asyncio.to_thread(kvgate, "keys", "list", *where)
    assert "acme" in listed.stdout and key not in listed.stdout


def test_keys_file_holds_digests_only(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys.jsonl"
    key = kvgate("keys", "create", "--tenant", "globex", "--keys-file", str(keys_file)).stdout.strip()
    text = keys_file.read_text()
    assert key not in text and "globex" in text
    assert keys_file.stat().st_mode & 0o777 == 0o600
    key_id = text.split('"key_id": "')[1][:12]
    kvgate("keys", "revoke", key_id, "--keys-file", str(keys_file))
    assert "globex" not in keys_file.read_text()
    refused = kvgate("keys", "create", "--tenant", "no spaces", "--keys-file", str(keys_file), check=False)
    assert refused.returncode == 2 and "tenant" in refused.stderr


def test_a_tenant_name_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    """``$`` also matches before a final newline: ``acme\\n`` was taken, a tenant apart from ``acme``
    (none of its limits or admin right, billed under another name)."""
    keys_file = tmp_path / "keys.jsonl"
    refused = kvgate("keys", "create", "--tenant", "acme\n", "--keys-file", str(keys_file), check=False)
    assert refused.returncode == 2 and "tenant" in refused.stderr
    assert not keys_file.exists()


async def test_a_malformed_line_in_the_keys_file_costs_only_that_line(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A hand-edited keys file (a comment, a torn or mistyped line) must not refuse every other key."""
    keys_file = tmp_path / "keys.jsonl"
    key = kvgate("keys", "create", "--tenant", "globex", "--keys-file", str(keys_file)).stdout.strip()
    with keys_file.open("a") as f:
        f.write('# acme\'s keys, added by hand\n{"sha256": "00ff", "tenant": "acme"\n[1, 2]\n')
    other = kvgate("keys", "create", "--tenant", "acme", "--keys-file", str(keys_file)).stdout.strip()
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True, "keys_file": str(keys_file)})
    for good in (key, other):
        status, body, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer(good))
        assert status == 200, body
    status, body, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer("kvg-unknown"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    listed = kvgate("keys", "list", "--keys-file", str(keys_file))
    assert "globex" in listed.stdout and "acme" in listed.stdout


async def test_a_key_revoked_or_created_within_the_keys_files_clock_tick_takes_effect(tmp_path: Path) -> None:
    """The keys file was read again only when its modification time changed. A file system whose clock
    ticks in whole seconds (ext4 with small inodes, many NFS mounts) gives a file written twice within a
    second one time: a key revoked (or created) within the second the gateway last read the file was never
    seen to go (or come), however long after."""
    keys_file = tmp_path / "keys.jsonl"
    key = kvgate("keys", "create", "--tenant", "globex", "--keys-file", str(keys_file)).stdout.strip()
    store = FileKeyStore(keys_file)
    assert await store.get(digest(key)) is not None
    tick = keys_file.stat().st_mtime_ns
    kvgate("keys", "revoke", digest(key)[:12], "--keys-file", str(keys_file))
    os.utime(keys_file, ns=(tick, tick))  # (the revocation came within the same tick)
    assert await store.get(digest(key)) is None
    tick = keys_file.stat().st_mtime_ns
    new = kvgate("keys", "create", "--tenant", "acme", "--keys-file", str(keys_file)).stdout.strip()
    os.utime(keys_file, ns=(tick, tick))
    assert await store.get(digest(new)) is not None


# -- isolation ------------------------------------------------------------------------------------------


async def test_tenants_never_share_cached_tokens(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    body = chat("What are your opening hours?")
    await cluster.post("/v1/chat/completions", body, headers=bearer(keys["acme"]))
    _, again, _ = await cluster.post("/v1/chat/completions", body, headers=bearer(keys["acme"]))
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(LONG) // 16 * 16 - 16
    _, other, _ = await cluster.post("/v1/chat/completions", body, headers=bearer(keys["globex"]))
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # same prompt, same engine
    assert other["usage"]["cost"] > again["usage"]["cost"]
    # Even a client-chosen cache_salt cannot reach another tenant's namespace.
    _, salted, _ = await cluster.post(
        "/v1/chat/completions", {**body, "cache_salt": "tenant:acme"}, headers=bearer(keys["globex"])
    )
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_the_ids_a_tenant_is_shown_say_nothing_of_other_tenants_requests(
    make_cluster: ClusterFactory,
) -> None:
    # The gateway's request ids (x-request-id) and the engine's answer ids (chatcmpl-...) were a prefix per
    # process and a counter: two ids a tenant got told it how many requests the others sent in between.
    cluster, keys = await billed_cluster(make_cluster)
    seen: list[tuple[str, str]] = []
    for _ in range(2):
        status, body, headers = await cluster.post(
            "/v1/chat/completions", chat("hi"), headers=bearer(keys["globex"])
        )
        assert status == 200, body
        seen.append((headers["x-request-id"], body["id"]))
        for _ in range(3):
            await cluster.post("/v1/chat/completions", chat("busy"), headers=bearer(keys["acme"]))
    for first, second in zip(*seen, strict=True):
        kind = first[: first.index("-") + 1]  # ("req-", "chatcmpl-")
        assert second.startswith(kind)
        shared = next(i for i, (a, b) in enumerate(zip(first + "\0", second, strict=False)) if a != b)
        assert shared < len(kind) + 8, (first, second)  # (8 more equal hex digits by chance: 2**-32)


async def test_session_ids_are_scoped_per_tenant(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(
        {"eu-west": 2}, auth={"enabled": True}, tenants=TENANTS, routing={"policy": "session"}
    )
    keys = {t: (await create_key(cluster.gateway.billing.keys, t))[0] for t in ("acme", "globex")}
    session = {"x-session-affinity": "conversation-42"}
    _, _, h1 = await cluster.post(
        "/v1/chat/completions", chat("a"), headers={**bearer(keys["acme"]), **session}
    )
    _, _, h2 = await cluster.post(
        "/v1/chat/completions", chat("b"), headers={**bearer(keys["acme"]), **session}
    )
    assert h2["x-kvgate-route"] == "session" and h2["x-kvgate-engine"] == h1["x-kvgate-engine"]
    _, body, h3 = await cluster.post(
        "/v1/chat/completions", chat("a"), headers={**bearer(keys["globex"]), **session}
    )
    assert h3["x-kvgate-route"] != "session"  # A's binding means nothing to B
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_declared_shared_prefix_is_reused_across_tenants(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster, shared_prefixes=[LONG])
    shared_tokens = len(cluster.gateway.prepare._shared[0]) // 16 * 16
    assert shared_tokens > 300
    _, a, _ = await cluster.post(
        "/v1/chat/completions", chat("acme question " * 8), headers=bearer(keys["acme"])
    )
    _, b, _ = await cluster.post(
        "/v1/chat/completions", chat("acme question " * 8), headers=bearer(keys["globex"])
    )
    b_cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    # B reuses the public system prompt A's request computed, but not A's own question after it.
    assert b_cached == shared_tokens < b["usage"]["prompt_tokens"] - 16
    _, b2, _ = await cluster.post(
        "/v1/chat/completions", chat("acme question " * 8), headers=bearer(keys["globex"])
    )
    assert b2["usage"]["prompt_tokens_details"]["cached_tokens"] > shared_tokens  # its own part, now cached
    assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


# -- limits ---------------------------------------------------------------------------------------------


async def test_rate_limit_answers_429_with_retry_after(make_cluster: ClusterFactory, redis_url: str) -> None:
    cluster, keys = await billed_cluster(make_cluster, redis_url=redis_url)
    answers = [
        await cluster.post("/v1/chat/completions", chat(f"q{i}"), headers=bearer(keys["tiny"]))
        for i in range(3)
    ]
    assert [status for status, _, _ in answers] == [200, 200, 429]
    _, body, headers = answers[2]
    assert body["error"]["code"] == "rate_limit_exceeded" and "RPM" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 60
    # The exact wait beside it (the OpenAI SDK reads it first), within the whole seconds rounded up.
    assert (
        int(headers["Retry-After"]) - 1 < int(headers["retry-after-ms"]) / 1000 <= int(headers["Retry-After"])
    )
    status, _, _ = await cluster.post("/v1/chat/completions", chat("q"), headers=bearer(keys["globex"]))
    assert status == 200  # other tenants are not affected


async def test_requests_refused_as_invalid_count_against_the_request_limit(
    make_cluster: ClusterFactory,
) -> None:
    """A key that floods the gateway with bodies it must validate and refuse pays for each of them."""
    cluster, keys = await billed_cluster(make_cluster)
    bad = {"model": MODEL, "messages": [{"role": "user"}]}  # no content: 400 after validation
    for _ in range(2):
        status, body, _ = await cluster.post("/v1/chat/completions", bad, headers=bearer(keys["tiny"]))
        assert status == 400, body
    status, body, _ = await cluster.post("/v1/chat/completions", chat("hi"), headers=bearer(keys["tiny"]))
    assert status == 429 and "RPM" in body["error"]["message"]


async def test_a_huge_message_count_is_refused_before_it_is_validated(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, max_messages=1000)
    many = {"model": MODEL, "messages": [{"role": "user", "content": ""}] * 200_000}
    status, body, _ = await cluster.post("/v1/chat/completions", many)
    assert (
        status == 400 and body["error"]["param"] == "messages" and "at most 1000" in body["error"]["message"]
    )
    parts = [{"type": "text", "text": "x"}] * 5000
    status, body, _ = await cluster.post(
        "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    )
    assert status == 400 and "content parts" in body["error"]["message"]
    status, _, _ = await cluster.post("/v1/chat/completions", chat("still fine"))
    assert status == 200


async def test_token_limit_counts_prompt_and_max_tokens(make_cluster: ClusterFactory) -> None:
    tenants = {"small": {"tokens_per_minute": 1000}}
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants=tenants)
    key = (await create_key(cluster.gateway.billing.keys, "small"))[0]
    status, _, _ = await cluster.post("/v1/chat/completions", chat("hi", max_tokens=10), headers=bearer(key))
    assert status == 200
    # (~800 prompt tokens + 150: within the minute's 1000, past what the first one left.)
    status, body, headers = await cluster.post(
        "/v1/chat/completions", chat("hi", max_tokens=150), headers=bearer(key)
    )
    assert status == 429 and "TPM" in body["error"]["message"] and "Retry-After" in headers
    assert 0 < int(headers["retry-after-ms"]) <= int(headers["Retry-After"]) * 1000


# OpenAI's rate-limit headers, and its duration format for the resets ("20ms", "8.64s", "6m0s").
RATE_HEADERS = [
    f"x-ratelimit-{what}-{unit}"
    for unit in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]
DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+(?:\.\d+)?)s|(\d+)ms)")


def seconds(duration: str) -> float:
    match = DURATION.fullmatch(duration)
    assert match, duration
    hours, minutes, secs, ms = match.groups()
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + float(secs or 0) + int(ms or 0) / 1000


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "per-gateway"])
async def test_answers_carry_openai_rate_limit_headers(
    make_cluster: ClusterFactory, redis_url: str, shared: bool
) -> None:
    """Every answer to a key with limits says what is left of each (streams on their head), counting down
    request by request; the 429 says it too, with Retry-After, and the OpenAI SDK reads it all."""
    tenants = {"limited": {"requests_per_minute": 3, "tokens_per_minute": 3000}, "open": {}}
    redis = {"redis_url": redis_url} if shared else {}
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants=tenants, **redis)
    store = cluster.gateway.billing.keys
    limited, open_key = [(await create_key(store, tenant))[0] for tenant in tenants]
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=limited, max_retries=0)
    heads = []
    for i in range(3):
        messages: Any = chat(f"q{i}")["messages"]
        if i == 1:  # a stream: on its response head
            raw: Any = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=4, stream=True
            )
            async for _ in raw.parse():
                pass
        else:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=4
            )
        heads.append(raw.headers)
    assert [h["x-ratelimit-limit-requests"] for h in heads] == ["3"] * 3
    assert [h["x-ratelimit-remaining-requests"] for h in heads] == ["2", "1", "0"]
    resets = [seconds(h["x-ratelimit-reset-requests"]) for h in heads]
    assert resets[0] <= 20 < resets[1] <= 40 < resets[2] <= 60  # one request refills in 20 s at 3 a minute
    tokens = [int(h["x-ratelimit-remaining-tokens"]) for h in heads]
    assert all(h["x-ratelimit-limit-tokens"] == "3000" for h in heads)
    assert 3000 > tokens[0] > tokens[1] > tokens[2] > 0, tokens  # each took its prompt + max_tokens
    assert 0 < seconds(heads[2]["x-ratelimit-reset-tokens"]) <= 60
    assert "retry-after" not in heads[0] and "retry-after-ms" not in heads[0]

    with pytest.raises(openai.RateLimitError) as refused:
        await client.chat.completions.create(model=MODEL, messages=chat("q3")["messages"], max_tokens=4)
    headers = refused.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 20
    assert (
        int(headers["retry-after"]) - 1 < int(headers["retry-after-ms"]) / 1000 <= int(headers["retry-after"])
    )
    assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-limit-tokens"] == "3000"
    assert refused.value.code == "rate_limit_exceeded" and refused.value.type == "requests"

    unlimited = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=open_key, max_retries=0)
    raw = await unlimited.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat("q")["messages"], max_tokens=4
    )
    assert [name for name in RATE_HEADERS if name in raw.headers] == []


async def test_a_token_limit_429_says_tokens(make_cluster: ClusterFactory) -> None:
    """Only the limits a tenant has get headers; the 429 of its token limit is OpenAI's ``tokens`` type."""
    tenants = {"small": {"tokens_per_minute": 1000}}
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants=tenants)
    key = (await create_key(cluster.gateway.billing.keys, "small"))[0]
    status, _, headers = await cluster.post(
        "/v1/chat/completions", chat("hi", max_tokens=10), headers=bearer(key)
    )
    assert status == 200 and headers["x-ratelimit-limit-tokens"] == "1000"
    assert "x-ratelimit-limit-requests" not in headers  # no request limit: no request headers
    before = int(headers["x-ratelimit-remaining-tokens"])
    status, body, headers = await cluster.post(
        "/v1/chat/completions", chat("hi", max_tokens=150), headers=bearer(key)
    )
    assert status == 429 and body["error"]["type"] == "tokens" and int(headers["Retry-After"]) >= 1
    assert 0 < int(headers["retry-after-ms"]) <= int(headers["Retry-After"]) * 1000
    assert 0 <= int(headers["x-ratelimit-remaining-tokens"]) <= before + 10
    assert seconds(headers["x-ratelimit-reset-tokens"]) > 0


@pytest.mark.parametrize("shared", [True, False], ids=["redis", "per-gateway"])
async def test_a_429_says_the_exact_wait_when_it_is_under_a_second(
    make_cluster: ClusterFactory, redis_url: str, shared: bool
) -> None:
    """At 120 requests a minute one request refills in half a second: the 429 says so in ``retry-after-ms``
    (the OpenAI SDK sleeps that, not the whole second of ``Retry-After``), and its message says it too; a
    client back after that wait is admitted. (It said 1 s at the least, and the time of a whole lease,
    about 3 s.)"""
    tenants = {"busy": {"requests_per_minute": 120}}
    redis = {"redis_url": redis_url} if shared else {}
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, tenants=tenants, **redis)
    key = (await create_key(cluster.gateway.billing.keys, "busy"))[0]
    for _ in range(200):  # (it refills meanwhile: until refused, not exactly 120)
        status, body, headers = await cluster.post(
            "/v1/chat/completions", chat("q", max_tokens=1), headers=bearer(key)
        )
        if status != 200:
            break
    assert status == 429 and body["error"]["type"] == "requests", body
    ms = int(headers["retry-after-ms"])
    assert 0 < ms <= 500 and headers["Retry-After"] == "1"
    assert body["error"]["message"].endswith(f"Please try again in {ms}ms."), body
    await asyncio.sleep(ms / 1000 + 0.01)
    status, body, _ = await cluster.post("/v1/chat/completions", chat("q", max_tokens=1), headers=bearer(key))
    assert status == 200, body


def test_resets_are_written_as_openai_writes_them() -> None:
    cases = {
        0.0: "0s",
        0.02: "20ms",
        0.0201: "21ms",
        1.0: "1s",
        8.64: "8.64s",
        360.0: "6m0s",
        90.5: "1m30.5s",
    }
    assert {s: reset_duration(s) for s in cases} == cases
    assert reset_duration(3600.0) == "1h0m0s"


# -- usage ----------------------------------------------------------------------------------------------


async def test_stream_usage_carries_the_cost_and_is_recorded_once(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=keys["acme"], max_retries=0)
    stream = await client.chat.completions.create(
        **chat("stream please"), stream=True, stream_options={"include_usage": True}
    )
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    assert usage is not None and usage["cost"] == pytest.approx(cost_of(usage) / 10**12)
    # Without include_usage the client sees no usage event, but the request is billed all the same.
    quiet = await client.chat.completions.create(**chat("quiet"), stream=True)
    assert all([c.usage is None async for c in quiet])
    await client.close()
    await cluster.gateway.billing.writer.flush()
    records = await cluster.gateway.billing.ledger.records()
    assert [r.status for r in records] == ["completed", "completed"]
    assert len({r.record_id for r in records}) == 2 and not any(r.estimated for r in records)


async def test_a_stream_the_client_abandons_is_billed_for_what_it_received(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster({"eu-west": 1}, sim={"decode_s_per_token": 0.02}, prices={MODEL: PRICE})
    assert cluster.session is not None
    body = chat("tell me a long story", max_tokens=200, stream=True)
    async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
        received = 0
        async for line in r.content:
            received += line.startswith(b"data:")
            if received == 5:
                break  # leaving the context closes the connection mid-stream
    ledger = cluster.gateway.billing.ledger
    await cluster.wait_for(lambda: len(ledger._records) == 1)  # type: ignore[attr-defined]
    await asyncio.sleep(0.3)  # ... and no second record follows
    [rec] = await ledger.records()
    assert rec.status == "aborted" and rec.estimated
    assert 4 <= rec.completion_tokens < 200 and rec.prompt_tokens > 0  # (the first event was the role chunk)
    assert rec.cost_picodollars == PRICES.cost_picodollars(
        rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens
    )


async def test_a_chat_stream_cut_by_its_engine_is_billed_for_its_tokens_not_its_role_chunk(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/cut": cut_stream(tokens=5)},
        engine_options={"eu-west/cut": {"kv_events": False}},
        prices={MODEL: PRICE},
    )
    assert cluster.session is not None
    async with cluster.session.post(cluster.url + "/v1/chat/completions", json=chat("hi", stream=True)) as r:
        text = (await r.read()).decode()
    assert r.status == 200 and text.count('"content":"x"') == 5 and "upstream_error" in text
    await cluster.gateway.billing.writer.flush()
    [rec] = await cluster.gateway.billing.ledger.records()
    assert rec.status == "failed" and rec.estimated
    assert rec.completion_tokens == 5  # the role chunk carried no token


async def test_a_stream_with_usage_in_every_chunk_is_billed_for_its_last_usage(
    make_cluster: ClusterFactory,
) -> None:
    # vLLM's stream_options.continuous_usage_stats (the client's stream_options reach the engine) puts the
    # running usage in every chunk, then sends the usage chunk with choices []. The bill is the last usage,
    # not the first chunk's (1 completion token), whatever the client asked for.
    tokens = [chat_chunk("x", usage=usage_of(20, i)) for i in range(1, 6)]
    final = chat_chunk(usage=usage_of(20, 5))
    engine = Scripted([chat_chunk(role=True), *tokens, final, b"data: [DONE]\n\n"], pause_at=2)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/vllm": engine.app},
        engine_options={"eu-west/vllm": {"kv_events": False}},
        prices={MODEL: PRICE},
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        **chat("count"),
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    usages = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            engine.resume.set()  # the first token's batch went through the gateway: send the rest
        if chunk.usage is not None:
            usages.append(chunk.usage.completion_tokens)
    await client.close()
    assert engine.bodies[0]["stream_options"]["continuous_usage_stats"] is True
    assert usages == [1, 2, 3, 4, 5, 5]
    ledger = cluster.gateway.billing.ledger
    await cluster.wait_for(lambda: len(ledger._records) == 1)  # type: ignore[attr-defined]
    [rec] = await ledger.records()
    assert (rec.status, rec.estimated, rec.prompt_tokens, rec.completion_tokens) == (
        "completed",
        False,
        20,
        5,
    )
    assert rec.cost_picodollars == PRICES.cost_picodollars(20, 0, 5)


async def test_a_whole_answer_without_usage_is_still_billed(make_cluster: ClusterFactory) -> None:
    # The engine answered (the client has its completion) but reported no usage: the request is billed by
    # the gateway's own counts, marked estimated, instead of leaving no record at all.
    message = {"role": "assistant", "content": "ok"}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}  # fmt: skip
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/nousage": answers(json.dumps(body).encode())},
        engine_options={"eu-west/nousage": {"kv_events": False}},
        prices={MODEL: PRICE},
    )
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    completion = await client.chat.completions.create(**chat("hi"))
    await client.close()
    assert completion.choices[0].message.content == "ok" and completion.usage is None
    await cluster.gateway.billing.writer.flush()
    records = await cluster.gateway.billing.ledger.records()
    assert [(r.status, r.estimated) for r in records] == [("completed", True)]
    assert records[0].prompt_tokens > 0 and records[0].cost_picodollars > 0


async def test_a_stream_with_usage_in_every_chunk_is_billed_for_all_its_tokens(
    third_party: ThirdPartyFleet, redis_url: str
) -> None:
    """vLLM's ``continuous_usage_stats`` (which the gateway forwards) puts the usage so far in every chunk:
    the ledger must take the engine's final usage, not the first chunk's (a stream billed as one token)."""
    cluster, _ = await third_party(
        {"eu-west/v": {"kind": "vllm", "decode_s_per_token": 0.01}},  # (chunks arrive one by one)
        auth={"enabled": True},
        redis_url=redis_url,
        prices={"tiny": PRICE},
    )
    key, _ = await create_key(cluster.gateway.billing.keys, "globex")
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count to twenty"}],
        max_tokens=20,
        stream=True,
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    usages = [chunk.usage.model_dump() async for chunk in stream if chunk.usage is not None]
    await client.close()
    final = usages[-1]
    assert final["completion_tokens"] == 20 and usages[0]["completion_tokens"] < 20
    await cluster.gateway.billing.writer.flush()
    [day] = await cluster.gateway.billing.ledger.daily("globex", day_of(time.time()), day_of(time.time()))
    assert (day.requests, day.prompt_tokens, day.completion_tokens) == (
        1,
        final["prompt_tokens"],
        final["completion_tokens"],
    )
    assert day.cost_picodollars == cost_of(final) and final["cost"] == pytest.approx(cost_of(final) / 10**12)


async def test_no_record_for_requests_that_never_reached_an_engine(make_cluster: ClusterFactory) -> None:
    cluster, keys = await billed_cluster(make_cluster)
    await cluster.post("/v1/chat/completions", {"model": MODEL}, headers=bearer(keys["acme"]))  # 400
    await cluster.post("/v1/chat/completions", chat("x", model="nope"), headers=bearer(keys["acme"]))  # 404
    await cluster.gateway.billing.writer.flush()
    assert await cluster.gateway.billing.ledger.records() == []


# -- the ledger through a Redis outage ------------------------------------------------------------------


async def test_redis_outage_during_200_requests_loses_and_doubles_nothing(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    cluster = await make_cluster({"eu-west": 2}, redis_url=private_redis.url, prices={MODEL: PRICE})
    writer = cluster.gateway.billing.writer
    writer._retry_s = 0.1  # notice Redis is back quickly (the default waits a second)
    billed: list[int] = []
    statuses: list[int] = []

    async def one(i: int) -> None:
        status, body, _ = await cluster.post("/v1/chat/completions", chat(f"request {i}"))
        statuses.append(status)
        if status == 200:
            billed.append(cost_of(body["usage"]))

    queue = list(range(200))

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            if i == 60:
                private_redis.stop()
            if i == 140:
                private_redis.start()
            await one(i)

    await asyncio.gather(*(worker() for _ in range(8)))
    assert statuses == [200] * 200
    assert writer.spooled > 0  # the outage was real: some records went through the spool
    deadline = asyncio.get_running_loop().time() + 15
    while writer.degraded or writer.pending:
        assert asyncio.get_running_loop().time() < deadline, "the ledger never caught up"
        await asyncio.sleep(0.05)
    client = aioredis.from_url(private_redis.url)
    ledger = RedisLedger(client, cluster.redis_prefix)
    today = day_of(time.time())
    [totals] = await ledger.daily("default", today, today)
    assert totals.requests == 200
    assert totals.cost_picodollars == sum(billed)
    assert await client.xlen(ledger.stream_key) == 200
    await client.aclose()


async def test_a_spool_that_refuses_writes_keeps_the_records_until_it_or_redis_is_back(
    make_cluster: ClusterFactory,
    private_redis: RedisProcess,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Redis away and the spool's directory gone (a file stands where it was: root cannot write there
    either): the writer keeps the records in memory, says so once and in /health and /metrics, and bills
    each one exactly once when the directory is back and then Redis."""
    directory = tmp_path / "spool"
    cluster = await make_cluster(
        {"eu-west": 1},
        redis_url=private_redis.url,
        prices={MODEL: PRICE},
        spool_path=str(directory / "ledger.spool"),
    )
    writer = cluster.gateway.billing.writer
    writer._retry_s = 0.05  # (the default retries every second)
    assert cluster.session is not None
    billed: list[int] = []

    async def one(i: int) -> None:
        status, body, _ = await cluster.post("/v1/chat/completions", chat(f"request {i}"))
        assert status == 200
        billed.append(cost_of(body["usage"]))

    async def read(path: str) -> str:
        assert cluster.session is not None
        async with cluster.session.get(cluster.url + path) as r:
            return await r.text()

    await one(0)
    await writer.flush()
    shutil.rmtree(directory)
    directory.write_text("not a directory")
    private_redis.stop()
    caplog.set_level(logging.WARNING, logger="kvgate.ledger")
    for i in range(1, 7):
        await one(i)
    await cluster.wait_for(lambda: writer.pending == 6 and writer.spool_failing)
    await asyncio.sleep(0.5)  # ten rounds of retries
    assert writer._task is not None and not writer._task.done(), "the ledger writer died"
    assert writer.pending == 6 and writer.spooled == 0
    refused = [r for r in caplog.records if "cannot write the ledger spool" in r.getMessage()]
    assert len(refused) == 1, "said once, not every retry"
    assert json.loads(await read("/health"))["ledger"] == "unsaved"
    metrics = await read("/metrics")
    assert "kvgate_ledger_spool_failing 1.0" in metrics and "kvgate_ledger_backlog 6.0" in metrics

    directory.unlink()  # the disk is back: the records go to the spool, Redis being still away
    directory.mkdir()
    await cluster.wait_for(lambda: writer.pending == 0 and not writer.spool_failing)
    assert writer.spooled == 6 and writer.degraded
    assert json.loads(await read("/health"))["ledger"] == "spooling"
    await one(7)
    private_redis.start()
    await cluster.wait_for(lambda: not writer.degraded and writer.pending == 0, within_s=15)
    assert json.loads(await read("/health"))["ledger"] == "ok"
    client = aioredis.from_url(private_redis.url)
    ledger = RedisLedger(client, cluster.redis_prefix)
    today = day_of(time.time())
    [totals] = await ledger.daily("default", today, today)
    assert totals.requests == 8 and totals.cost_picodollars == sum(billed)
    assert await client.xlen(ledger.stream_key) == 8
    await client.aclose()


async def test_records_the_spool_refused_go_to_redis_when_it_is_back_first(
    make_cluster: ClusterFactory, private_redis: RedisProcess, tmp_path: Path
) -> None:
    """The other order: Redis comes back while the spool's directory is still gone."""
    directory = tmp_path / "spool"
    cluster = await make_cluster(
        {"eu-west": 1}, redis_url=private_redis.url, spool_path=str(directory / "ledger.spool")
    )
    writer = cluster.gateway.billing.writer
    writer._retry_s = 0.05
    shutil.rmtree(directory)
    directory.write_text("not a directory")
    private_redis.stop()
    for i in range(5):
        status, _, _ = await cluster.post("/v1/chat/completions", chat(f"request {i}"))
        assert status == 200
    await cluster.wait_for(lambda: writer.pending == 5 and writer.spool_failing)
    private_redis.start()
    await cluster.wait_for(lambda: writer.pending == 0 and not writer.degraded, within_s=15)
    assert not writer.spool_failing and writer.spooled == 0 and writer.written == 5
    client = aioredis.from_url(private_redis.url)
    ledger = RedisLedger(client, cluster.redis_prefix)
    assert await client.xlen(ledger.stream_key) == 5
    await client.aclose()


async def test_a_disk_that_refuses_the_usage_journal_fails_no_request_and_loses_no_record(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    """The journal's segment on a full disk (its descriptor pointed at /dev/full: every write ENOSPC):
    every request is still answered and billed; /health and /metrics say the journal is failing."""
    cluster = await make_cluster(
        {"eu-west": 1}, redis_url=redis_url, redis_prefix=redis_keys.prefix, prices={MODEL: PRICE}
    )
    journal = cluster.gateway.billing.journal
    assert journal is not None and journal._fd is not None
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, journal._fd)
    os.close(full)
    billed = []
    for i in range(3):
        status, body, _ = await cluster.post("/v1/chat/completions", chat(f"request {i}"))
        assert status == 200, body
        billed.append(cost_of(body["usage"]))
    assert cluster.session is not None
    body = chat("a stream", stream=True, stream_options={"include_usage": True})
    async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        events = [line[6:] for line in (await r.text()).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    billed.append(cost_of(json.loads(events[-2])["usage"]))
    await cluster.gateway.billing.writer.flush()
    async with cluster.session.get(cluster.url + "/health") as r:
        assert (await r.json())["journal"] == "failing"
    async with cluster.session.get(cluster.url + "/metrics") as r:
        metrics = await r.text()
    assert "kvgate_usage_journal_failing 1.0" in metrics
    assert "kvgate_usage_journal_write_failures_total " in metrics and journal.write_failures >= 8
    ledger = RedisLedger(aioredis.from_url(redis_url), redis_keys.prefix)
    today = day_of(time.time())
    [totals] = await ledger.daily("default", today, today)
    assert totals.requests == 4 and totals.cost_picodollars == sum(billed)


async def test_kvgate_usage_reads_the_redis_ledger(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1}, redis_url=redis_url, redis_prefix=redis_keys.prefix, prices={MODEL: PRICE}
    )
    billed = 0
    for i in range(3):
        _, body, _ = await cluster.post("/v1/chat/completions", chat(f"q{i}"))
        billed += cost_of(body["usage"])
    await cluster.gateway.billing.writer.flush()
    where = ["--redis", redis_url, "--redis-prefix", redis_keys.prefix]
    result = await asyncio.to_thread(kvgate, "usage", "--json", *where)
    from_redis = json.loads(result.stdout)
    [entry] = from_redis["data"]
    assert entry["tenant"] == "default" and entry["data"][0]["requests"] == 3
    assert entry["data"][0]["cost_picodollars"] == billed
    # --json prints the gateway's shape, read from Redis too (it had no totals and no day objects).
    assert from_redis["object"] == "list" and entry["data"][0]["object"] == "usage.day"
    assert from_redis["total"]["requests"] == entry["total"]["requests"] == 3
    assert from_redis["total"]["cost_picodollars"] == billed
    alone = await asyncio.to_thread(kvgate, "usage", "--json", "--tenant", "nobody", *where)
    assert json.loads(alone.stdout)["data"] == [] and json.loads(alone.stdout)["total"]["requests"] == 0
    table = (await asyncio.to_thread(kvgate, "usage", *where)).stdout
    assert "default" in table and "REQUESTS" in table


async def test_kvgate_usage_of_one_tenant_from_a_gateway_totals_only_that_tenant(
    make_cluster: ClusterFactory,
) -> None:
    """``kvgate usage --url --tenant NAME --json`` showed that tenant's days under a ``total`` of every
    tenant's: an operator reading one tenant's bill was shown the others' requests and cost in it."""
    cluster, keys = await billed_cluster(make_cluster)
    billed = {}
    for tenant in ("acme", "globex"):
        _, body, _ = await cluster.post("/v1/chat/completions", chat(tenant), headers=bearer(keys[tenant]))
        billed[tenant] = cost_of(body["usage"])
    await cluster.gateway.billing.writer.flush()
    result = await asyncio.to_thread(
        kvgate, "usage", "--url", cluster.url, "--key", keys["acme"], "--tenant", "globex", "--json"
    )
    body = json.loads(result.stdout)
    assert [entry["tenant"] for entry in body["data"]] == ["globex"]
    assert body["total"]["requests"] == 1
    assert body["total"]["cost_picodollars"] == billed["globex"]


def test_a_client_salt_never_names_another_tenants_namespace() -> None:
    """A tenant configured with the shared (empty) salt whose client sends another tenant's salt, or two
    tenant/client splits that read alike joined, must land in namespaces of their own."""

    def salt(tenant_salt: str, client_salt: str) -> str:
        parsed = parse_completion({"model": "m", "prompt": "p", "cache_salt": client_salt})
        return _cache_salt(Tenant("t", tenant_salt), parsed)

    acme = tenant_from_config("acme", None).cache_salt
    assert salt("", acme) != acme
    assert salt("a/b", "c") != salt("a", "b/c")
    assert salt("tenant:acme", "alice") != salt("tenant:acme", "bob")
