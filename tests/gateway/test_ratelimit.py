"""Token buckets: one allowance shared by every gateway through Redis, refilled by elapsed time."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from cache.redis_keys import RedisKeys
from gateway.tenancy.ratelimit import BucketStore, LimitExceeded, MemoryBuckets, RateLimiter, RedisBuckets


@pytest.fixture(params=["memory", "redis"])
def buckets(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> BucketStore:
    return MemoryBuckets() if request.param == "memory" else RedisBuckets(redis_client, redis_keys.prefix)


async def test_a_bucket_grants_its_capacity_then_refills_with_time(buckets: BucketStore) -> None:
    started = time.monotonic()
    granted, wait, left = await buckets.take("k", 5, 10.0, 3)
    assert (granted, wait) == (3, 0.0) and left == pytest.approx(2, abs=0.05)  # (and what is left)
    granted, wait, left = await buckets.take("k", 5, 10.0, 4)
    assert granted == 2 and wait == pytest.approx(2 / 10.0, abs=0.05)  # two more refill in 0.2 s
    # What is left is what refilled between the takes (10 a second): a busy machine takes more than 5 ms.
    assert left <= 10.0 * (time.monotonic() - started) + 0.01
    await asyncio.sleep(0.55)  # 5 tokens at 10/s
    assert (await buckets.take("k", 5, 10.0, 5))[0] == 5


async def test_gateways_sharing_redis_share_one_allowance(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    gateways = [RateLimiter(RedisBuckets(redis_client, redis_keys.prefix)) for _ in range(3)]
    admitted = 0
    for i in range(12):
        try:
            await gateways[i % 3].spend("key1:rpm", 6, 1, "requests per min (RPM)")
            admitted += 1
        except LimitExceeded as exc:
            assert 0 < exc.retry_after_s <= 10.0  # one request refills in 10 s at 6 a minute
    assert admitted == 6  # not 6 per gateway


async def test_each_spend_says_what_remains_and_when_the_bucket_is_full_again(
    buckets: BucketStore,
) -> None:
    """The figures of OpenAI's x-ratelimit-* headers, from the lease and the store's last answer: they count
    down request by request (a lease of one request at 6 per minute: each spend takes from the store)."""
    limiter = RateLimiter(buckets)
    seen = [await limiter.spend("k:rpm", 6, 1, "RPM") for _ in range(6)]
    assert [a.remaining for a in seen] == [5, 4, 3, 2, 1, 0]
    assert all(a.limit == 6 for a in seen)
    # Each spent request refills in 10 s at 6 per minute: full again after (spent x 10 s), less a little.
    for spent, allowance in enumerate(seen, start=1):
        assert spent * 10 - 1 < allowance.reset_s <= spent * 10
    with pytest.raises(LimitExceeded) as refused:
        await limiter.spend("k:rpm", 6, 1, "RPM")
    assert refused.value.allowance.remaining == 0 and refused.value.allowance.reset_s > 59


async def test_a_lease_counts_down_without_the_store() -> None:
    store = CountingBuckets()
    limiter = RateLimiter(store)
    seen = [await limiter.spend("k:rpm", 60, 1, "RPM") for _ in range(3)]
    assert store.takes == 1  # one lease of 3 requests served all three
    assert [a.remaining for a in seen] == [59, 58, 57]


async def test_a_request_larger_than_the_limit_is_refused_outright() -> None:
    limiter = RateLimiter(MemoryBuckets())
    with pytest.raises(LimitExceeded, match="Requested 5000"):
        await limiter.spend("k:tpm", 1000, 5000, "tokens per min (TPM)")


async def test_without_redis_the_limit_holds_per_gateway() -> None:
    unreachable = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    limiter = RateLimiter(RedisBuckets(unreachable, "x"))
    remaining = [(await limiter.spend("k:rpm", 3, 1, "RPM")).remaining for _ in range(3)]
    assert remaining == [2, 1, 0]
    with pytest.raises(LimitExceeded) as refused:
        await limiter.spend("k:rpm", 3, 1, "RPM")
    assert refused.value.allowance.remaining == 0  # the figures come from this gateway's own bucket
    await unreachable.aclose()


# -- concurrent spends on one bucket --------------------------------------------------------------------


class CountingBuckets(MemoryBuckets):
    """In-process buckets that count what they grant and, like any store across a network, let other
    requests run while a take is on its way."""

    def __init__(self) -> None:
        super().__init__()
        self.granted = 0
        self.takes = 0

    async def take(self, bucket: str, capacity: int, per_s: float, want: int) -> tuple[int, float, float]:
        self.takes += 1
        await asyncio.sleep(0)  # the answer comes back in a later turn of the event loop
        granted, wait, left = await super().take(bucket, capacity, per_s, want)
        self.granted += granted
        return granted, wait, left


async def test_concurrent_spends_through_redis_neither_refuse_nor_drain_the_shared_bucket(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    limiter = RateLimiter(RedisBuckets(redis_client, redis_keys.prefix))
    results = await asyncio.gather(
        *(limiter.spend("key1:rpm", 600, 1, "requests per min (RPM)") for _ in range(64)),
        return_exceptions=True,
    )
    assert [r for r in results if isinstance(r, BaseException)] == []  # no LimitExceeded for 64 of 600
    tokens = float(await redis_client.hget(f"{redis_keys.prefix}:rl:{{key1:rpm}}", "tokens") or 0)
    lease = 600 // 20
    # Other gateways still find (at least) all but what this one spent plus one lease in reserve.
    assert tokens >= 600 - 64 - lease


async def test_concurrent_spends_neither_lose_nor_double_count_allowance() -> None:
    store = CountingBuckets()
    limiter = RateLimiter(store)
    results = await asyncio.gather(
        *(limiter.spend("k:tpm", 600, 7, "tokens per min (TPM)") for _ in range(64)),
        return_exceptions=True,
    )
    assert [r for r in results if isinstance(r, BaseException)] == []  # 448 of 600
    # Everything taken from the store was spent or is still held as this gateway's lease.
    assert store.granted == 64 * 7 + limiter._leases["k:tpm"]
    assert store.granted <= 64 * 7 + 30  # and at most one lease more than was spent
    # Spending on until refused takes the rest of the bucket, and still loses and doubles nothing.
    spent = 64 * 7
    with pytest.raises(LimitExceeded) as refused:
        while True:
            await limiter.spend("k:tpm", 600, 7, "tokens per min (TPM)")
            spent += 7
    assert store.granted == spent + limiter._leases["k:tpm"]
    assert spent > 600 - 2 * 7  # refused only once the store had less than one request's worth left
    assert 0 < refused.value.retry_after_s <= 0.7  # what one request of 7 lacks, at 10 a second


async def test_a_debit_is_paid_back_before_the_next_spend_and_never_refused(buckets: BucketStore) -> None:
    """Tokens already generated past what was charged come out of the next spends: a bucket of 600 a minute
    debited 590 has 10 left, says so, and refuses 20 until enough has refilled (10 a second)."""
    limiter = RateLimiter(buckets)
    await limiter.spend("k:tpm", 600, 1, "TPM")
    limiter.debit("k:tpm", 590)  # (however much is left: what was generated is spent)
    assert limiter.allowance("k:tpm", 600).remaining <= 9
    with pytest.raises(LimitExceeded) as refused:
        await limiter.spend("k:tpm", 600, 20, "TPM")
    assert 0.5 < refused.value.retry_after_s <= 2.0
    limiter.debit("k:tpm", 10_000)  # more than the whole allowance: nothing remains, for over a minute
    assert limiter.allowance("k:tpm", 600) == (600, 0, pytest.approx(1060, abs=2))


async def test_a_refusal_says_the_exact_wait_for_what_was_asked_even_under_a_second(
    buckets: BucketStore,
) -> None:
    """At 600 requests a minute one request refills in 0.1 s: the refusal says that, not the second it was
    floored to, nor the time the gateway's next lease (30 requests, 3 s) would take; and after that wait
    the request is admitted (the OpenAI SDK sleeps ``retry-after-ms`` and tries again)."""
    limiter = RateLimiter(buckets)
    with pytest.raises(LimitExceeded) as refused:
        for _ in range(700):  # (the bucket refills while it is spent: until refused, not exactly 600)
            await limiter.spend("k:rpm", 600, 1, "RPM")
    assert 0 < refused.value.retry_after_s <= 0.1
    await asyncio.sleep(refused.value.retry_after_s + 0.005)  # (Redis's clock and this one: a little over)
    assert (await limiter.spend("k:rpm", 600, 1, "RPM")).limit == 600
