"""The usage ledger: exact cost arithmetic, one contract for the in-process and Redis ledgers, the spool, and
the writer that keeps every record through a Redis outage (a real redis-server, stopped and restarted)."""

from __future__ import annotations

import asyncio
import os
import random
import stat
import time
from collections.abc import AsyncIterator
from decimal import Decimal
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from cache.ledger import MemoryLedger, Prices, UsageLedger, UsageRecord, day_of, days_between, dollars
from cache.ledger_redis import RedisLedger
from cache.redis_keys import RedisKeys
from cache.spool import Spool
from gateway.tenancy.billing import usage_counts
from gateway.tenancy.ledger_writer import LedgerWriter
from tests.redis_process import RedisProcess

PRICES = Prices(Decimal("0.50"), Decimal("0.05"), Decimal("1.50"))


# -- cost arithmetic ------------------------------------------------------------------------------------


def test_cost_counts_cached_tokens_inside_prompt_tokens() -> None:
    # OpenAI's prompt_tokens INCLUDES prompt_tokens_details.cached_tokens: 1000 prompt tokens of which 600
    # cached is 400 at the input price and 600 at the cached price, not 1000 + 600.
    cost = PRICES.cost_picodollars(prompt_tokens=1000, cached_tokens=600, completion_tokens=100)
    expected = (400 * Decimal("0.50") + 600 * Decimal("0.05") + 100 * Decimal("1.50")) / 10**6
    assert Decimal(cost) / 10**12 == expected
    assert cost == 380_000_000


def test_cost_is_exact_for_prices_that_floats_cannot_hold() -> None:
    prices = Prices(Decimal("0.075"), Decimal("0.01875"), Decimal("0.3"))  # six decimals at most
    rng = random.Random(7)
    total_picodollars, total_exact = 0, Decimal(0)
    for _ in range(10_000):
        prompt = rng.randint(0, 100_000)
        cached = rng.randint(0, prompt)
        completion = rng.randint(0, 4000)
        total_picodollars += prices.cost_picodollars(prompt, cached, completion)
        total_exact += (
            (prompt - cached) * prices.input + cached * prices.cached_input + completion * prices.output
        ) / 10**6
    assert Decimal(total_picodollars) / 10**12 == total_exact  # a float sum would drift


@pytest.mark.parametrize(("prompt", "cached", "completion"), [(10, 11, 0), (-1, 0, 0), (10, 0, -1)])
def test_cost_refuses_impossible_counts(prompt: int, cached: int, completion: int) -> None:
    with pytest.raises(ValueError):
        PRICES.cost_picodollars(prompt, cached, completion)


def test_usage_counts_follow_openai_conventions() -> None:
    usage = {"prompt_tokens": 50, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 32}}
    assert usage_counts(usage) == (50, 32, 7)
    assert usage_counts({"prompt_tokens": 5, "completion_tokens": 1}) == (5, 0, 1)  # no details: none cached
    # An engine claiming more cached than prompt tokens is capped; junk counts count as zero.
    assert usage_counts({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}}) == (5, 5, 0)
    assert usage_counts({"prompt_tokens": "5", "completion_tokens": True}) == (0, 0, 0)
    assert usage_counts(None) == (0, 0, 0)


def test_day_ranges() -> None:
    assert days_between("2026-02-27", "2026-03-01") == ["2026-02-27", "2026-02-28", "2026-03-01"]
    with pytest.raises(ValueError):
        days_between("2026-03-02", "2026-03-01")
    assert day_of(0) == "1970-01-01"


def test_a_range_holds_at_most_366_days_both_ends_counted() -> None:
    """The refusal says "at most 366 days": a leap year whole is 366 days, and a 367th day is refused (it
    was answered, a read of 367 days under a limit that said 366)."""
    assert len(days_between("2028-01-01", "2028-12-31")) == 366
    with pytest.raises(ValueError, match="at most 366 days"):
        days_between("2025-12-06", "2026-12-07")


# -- one contract, two ledgers --------------------------------------------------------------------------


@pytest.fixture(params=["memory", "redis"])
async def ledger(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> AsyncIterator[UsageLedger]:
    yield MemoryLedger() if request.param == "memory" else RedisLedger(redis_client, redis_keys.prefix)


def record(i: int, tenant: str = "acme", ts: float | None = None, **kw: object) -> UsageRecord:
    prompt, cached, completion = 100 + i, i % 100, i % 17
    fields: dict[str, object] = {
        "record_id": f"r{i}",
        "tenant": tenant,
        "model": "m",
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "cost_picodollars": PRICES.cost_picodollars(prompt, cached, completion),
        "ts": time.time() if ts is None else ts,
        **kw,
    }
    return UsageRecord(**fields)  # type: ignore[arg-type]


async def test_a_record_counts_once_however_often_it_is_delivered(ledger: UsageLedger) -> None:
    rec = record(1)
    assert await ledger.record(rec) is True
    assert await ledger.record(rec) is False  # a retry, a spool replay, a second gateway
    assert await ledger.record(record(1, completion_tokens=999)) is False  # same id, whatever it says
    [totals] = await ledger.daily("acme", rec.day, rec.day)
    assert (totals.requests, totals.prompt_tokens, totals.cost_picodollars) == (1, 101, rec.cost_picodollars)
    assert [r.record_id for r in await ledger.records()] == ["r1"]


@pytest.mark.parametrize("first", ["completed", "estimated"])
async def test_a_request_that_ran_across_midnight_counts_once_whichever_day_its_records_name(
    ledger: UsageLedger, first: str
) -> None:
    """A record's day is the day its time names: the gateway's record takes the completion's time, an
    estimate replayed from the journal (its ``final`` entry lost) the dispatch's. Across midnight they name
    two days, and the Redis ledger's record ids were remembered per day, so both counted."""
    midnight = 1_790_035_200.0  # 2026-09-22T00:00:00Z
    assert midnight % 86_400 == 0
    completed = record(7, ts=midnight + 5)
    estimated = record(7, ts=midnight - 5, estimated=True, completion_tokens=0)
    one, other = (completed, estimated) if first == "completed" else (estimated, completed)
    assert await ledger.record(one) is True
    assert await ledger.record(other) is False
    assert await ledger.record_many([other, one]) == 0
    days = await ledger.daily("acme", day_of(midnight - 5), day_of(midnight + 5))
    assert [(d.day, d.requests, d.cost_picodollars) for d in days] == [(one.day, 1, one.cost_picodollars)]
    assert [r.record_id for r in await ledger.records()] == ["r7"]


async def test_sums_per_tenant_and_day_are_exact(ledger: UsageLedger) -> None:
    day1, day2 = 1_790_000_000.0, 1_790_000_000.0 + 86_400
    recs = [record(i, tenant="acme" if i % 3 else "globex", ts=day1 if i < 40 else day2) for i in range(60)]
    for r in recs:
        await ledger.record(r)
    start, end = day_of(day1), day_of(day2)
    for tenant in ("acme", "globex"):
        days = await ledger.daily(tenant, start, end)
        assert [d.day for d in days] == [start, end]
        mine = [r for r in recs if r.tenant == tenant]
        assert sum(d.requests for d in days) == len(mine)
        assert sum(d.cost_picodollars for d in days) == sum(r.cost_picodollars for r in mine)
        assert sum(d.cached_tokens for d in days) == sum(r.cached_tokens for r in mine)
    everyone = await ledger.tenants(start, end)
    assert sorted(everyone) == ["acme", "globex"]
    assert await ledger.daily("acme", "2001-01-01", "2001-01-02") == []
    assert len(await ledger.records(tenant="globex")) == 20
    assert [r.record_id for r in await ledger.records(limit=2)] == ["r58", "r59"]  # newest last


async def test_redis_ledger_stream_holds_each_record_once(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    ledger = RedisLedger(redis_client, redis_keys.prefix)
    for rec in [record(1), record(2), record(1)]:
        await ledger.record(rec)
    assert await redis_client.xlen(ledger.stream_key) == 2
    # Every key of one record shares a hash tag: the script is valid on a Redis Cluster too.
    keys = [k.decode() async for k in redis_client.scan_iter(match=f"*{redis_keys.prefix}*")]
    assert keys and all(f"{{{redis_keys.prefix}:ledger}}" in k for k in keys)


# -- the spool ------------------------------------------------------------------------------------------


def test_the_spool_stays_private_after_a_replay_clears_part_of_it(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.spool")
    spool.append([record(1), record(2), record(3)])
    assert stat.S_IMODE(spool.path.stat().st_mode) == 0o600
    spool.clear(2)
    assert stat.S_IMODE(spool.path.stat().st_mode) == 0o600
    assert [r.record_id for r in spool.read()] == ["r3"]


def test_spool_survives_a_torn_last_record(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.spool")
    spool.append([record(1), record(2)])
    spool.append([record(3)])
    with open(spool.path, "ab") as f:
        f.write(b"\x8f\xa9record_id")  # a crash in the middle of the next append
    assert [r.record_id for r in spool.read()] == ["r1", "r2", "r3"]
    assert os.stat(spool.path).st_mode & 0o777 == 0o600
    spool.clear(2)
    assert [r.record_id for r in spool.read()] == ["r3"]


# -- the writer, through a real outage ------------------------------------------------------------------


async def test_writer_spools_through_an_outage_and_replays_exactly_once(
    private_redis: RedisProcess, tmp_path: Path
) -> None:
    client = aioredis.from_url(private_redis.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    ledger = RedisLedger(client)
    writer = LedgerWriter(ledger, Spool(tmp_path / "ledger.spool"), retry_s=0.1, write_timeout_s=1.0)
    await writer.start()
    recs = [record(i) for i in range(90)]
    try:
        for rec in recs[:30]:
            writer.submit(rec)
        await writer.flush()
        private_redis.stop()
        for rec in recs[30:60]:
            writer.submit(rec)
        await writer.flush()
        assert writer.degraded and writer.spooled >= 30
        writer.submit(recs[10])  # a duplicate delivery, while Redis is away
        await writer.flush()
        private_redis.start()
        for rec in recs[60:]:
            writer.submit(rec)
        deadline = time.monotonic() + 10
        while writer.degraded or writer.pending:
            assert time.monotonic() < deadline, "the writer never recovered"
            await asyncio.sleep(0.05)
        await writer.flush()
    finally:
        await writer.stop()
    assert writer.spool is not None and writer.spool.read() == []
    day = recs[0].day
    [totals] = await ledger.daily("acme", day, day)
    assert totals.requests == 90
    assert totals.cost_picodollars == sum(r.cost_picodollars for r in recs)
    assert await client.xlen(ledger.stream_key) == 90
    await client.aclose()


async def test_a_restarted_writer_replays_the_spool_it_left(
    redis_client: aioredis.Redis, redis_keys: RedisKeys, tmp_path: Path
) -> None:
    spool = Spool(tmp_path / "ledger.spool")
    spool.append([record(1), record(2)])  # what a gateway stopped during an outage left behind
    ledger = RedisLedger(redis_client, redis_keys.prefix)
    await ledger.record(record(1))  # ... one of which had reached Redis before the connection broke
    writer = LedgerWriter(ledger, spool)
    await writer.start()
    await writer.stop()
    assert spool.read() == []
    day = record(1).day
    [totals] = await ledger.daily("acme", day, day)
    assert totals.requests == 2
    assert dollars(totals.cost_picodollars) == pytest.approx(
        dollars(record(1).cost_picodollars + record(2).cost_picodollars)
    )


async def test_stop_spools_what_it_could_not_write(tmp_path: Path) -> None:
    never_started = RedisProcess(tmp_path)  # a port nothing listens on: every write is refused
    client = aioredis.from_url(never_started.url, socket_connect_timeout=0.5)
    spool = Spool(tmp_path / "s.spool")
    writer = LedgerWriter(RedisLedger(client), spool, retry_s=0.05)
    await writer.start()
    for i in range(5):
        writer.submit(record(i))
    await writer.stop()
    assert sorted(r.record_id for r in spool.read()) == [f"r{i}" for i in range(5)]
    await client.aclose()


async def test_pending_counts_the_records_a_spool_write_in_progress_holds(tmp_path: Path) -> None:
    """While a spool write is under way (a slow disk: here a FIFO, whose open for reading waits for a writer),
    its records are in neither the queue nor the refused list: ``pending`` (the kvgate_ledger_backlog gauge)
    must still count them, not drop to 0 until the write is done."""
    never_started = RedisProcess(tmp_path)  # a port nothing listens on: every ledger write is refused
    client = aioredis.from_url(never_started.url, socket_connect_timeout=0.5)
    path = tmp_path / "s.spool"
    writer = LedgerWriter(RedisLedger(client), Spool(path), retry_s=0.05)
    await writer.start()
    os.mkfifo(path)  # the spool's first append reads what is there first (a torn tail): that read waits
    for i in range(3):
        writer.submit(record(i))
    deadline = time.monotonic() + 10
    while True:  # a write end opens only once the spool's thread has the FIFO open for reading
        try:
            fifo = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert time.monotonic() < deadline, "the writer never began its spool write"
            await asyncio.sleep(0.01)
    try:
        await asyncio.sleep(0.1)  # (the thread now waits in read(): nothing can finish meanwhile)
        assert writer.pending == 3 and writer.spooled == 0
    finally:
        os.unlink(path)  # the append that follows the read creates a plain file
        os.close(fifo)  # end of input: the read returns
    await writer.flush()
    assert writer.pending == 0 and writer.spooled == 3
    await writer.stop()
    assert sorted(r.record_id for r in Spool(path).read()) == ["r0", "r1", "r2"]
    await client.aclose()


async def test_record_many_counts_each_id_once(ledger: UsageLedger) -> None:
    assert await ledger.record_many([record(1), record(2), record(1)]) == 2
    assert await ledger.record_many([record(2), record(3)]) == 1
    day = record(1).day
    [totals] = await ledger.daily("acme", day, day)
    assert totals.requests == 3


async def test_the_memory_ledger_keeps_sums_but_bounds_its_records() -> None:
    ledger = MemoryLedger(keep_records=10)
    await ledger.record_many([record(i) for i in range(250)])
    assert len(ledger) == 10 and len(ledger._seen) <= 100
    day = record(0).day
    [totals] = await ledger.daily("acme", day, day)
    assert totals.requests == 250
