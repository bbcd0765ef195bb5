"""Per-key rate limits: requests and tokens per minute, as token buckets.

The buckets live in Redis (one Lua script: refill by elapsed server time, then take) when gateways share
it, so every gateway draws from the same allowance. To keep the request path off Redis, a gateway takes
allowance in leases of about 1/20 of a minute's worth and spends them locally; it goes back to Redis only
when a lease runs out, with one refill per bucket at a time however many requests wait on it. Without Redis
(or while it is away or slow) the buckets are in process. An exhausted bucket answers 429 with the
seconds until enough has refilled for the refused spend (not for a whole lease; under a second when that is
all it takes).

Each spend also says where the bucket stands (``Allowance``: remaining and time until full again, what the
OpenAI ``x-ratelimit-*`` headers carry), from what the last take from the store said and this gateway's
lease, without asking the store again.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from typing import NamedTuple, Protocol

from cache.redis_client import REDIS_FAILURES_OR_LATE, AnyRedis
from gateway.state.single_flight import SingleFlight

STORE_TIMEOUT_S = 0.5  # a slow Redis must not hold requests up: fall back to this gateway's buckets

# KEYS[1] the bucket hash. ARGV: capacity, refill per second, wanted. Returns {granted, ms until the rest
# refills, thousandths of a token left} (Redis makes Lua numbers integers: what is left in milli-tokens).
_TAKE = """
local capacity, rate, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(state[1]), tonumber(state[2])
if not tokens then tokens, ts = capacity, now end
tokens = math.min(capacity, tokens + (now - ts) * rate)
local granted = math.min(math.floor(tokens), want)
tokens = tokens - granted
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(capacity / rate * 1000) + 1000)
local wait = 0
if granted < want then wait = math.ceil((want - granted - tokens) / rate * 1000) end
return {granted, wait, math.floor(tokens * 1000)}
"""


class BucketStore(Protocol):
    async def take(self, bucket: str, capacity: int, per_s: float, want: int) -> tuple[int, float, float]:
        """Take up to ``want``: (granted, seconds until the rest would have refilled, tokens left after)."""
        ...


class Allowance(NamedTuple):
    """Where a key's bucket stands after a spend (or a refusal): what OpenAI's rate-limit headers say."""

    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again at its refill rate


class MemoryBuckets:
    def __init__(self) -> None:
        self._state: dict[str, tuple[float, float]] = {}

    async def take(self, bucket: str, capacity: int, per_s: float, want: int) -> tuple[int, float, float]:
        now = time.monotonic()
        tokens, ts = self._state.get(bucket, (float(capacity), now))
        tokens = min(float(capacity), tokens + (now - ts) * per_s)
        granted = min(int(tokens), want)
        tokens -= granted
        self._state[bucket] = (tokens, now)
        wait = 0.0 if granted >= want else (want - granted - tokens) / per_s
        return granted, wait, tokens


class RedisBuckets:
    def __init__(self, redis: AnyRedis, prefix: str = "kvgate") -> None:
        self._prefix = prefix
        self._take = redis.register_script(_TAKE)

    async def take(self, bucket: str, capacity: int, per_s: float, want: int) -> tuple[int, float, float]:
        key = f"{self._prefix}:rl:{{{bucket}}}"
        granted, wait_ms, left_milli = await self._take(keys=[key], args=[capacity, per_s, want])
        return int(granted), int(wait_ms) / 1000.0, int(left_milli) / 1000.0


class LimitExceeded(Exception):
    def __init__(
        self, what: str, retry_after_s: float, allowance: Allowance, *, too_large: bool = False
    ) -> None:
        super().__init__(what)
        self.what = what
        self.retry_after_s = retry_after_s
        self.allowance = allowance
        self.too_large = too_large  # more than the whole limit: no wait makes it fit


class RateLimiter:
    """Spends allowance from this gateway's leases; refills a lease from the store when it runs short.

    Concurrent spends on one bucket share one refill: the first starts it, the others await the same one
    and then look at the lease again. The grant is added to the lease as it is when the grant arrives
    (spends ran meanwhile), so no allowance is lost or counted twice, and a burst takes one lease from the
    shared bucket at a time instead of one per request.
    """

    def __init__(self, store: BucketStore, *, lease_fraction: float = 0.05) -> None:
        self.store = store
        self._fallback = MemoryBuckets()  # while the shared store is away: limits per gateway, not none
        self._lease_fraction = lease_fraction
        self._leases: dict[str, int] = {}
        self._refills: SingleFlight[str, tuple[int, int, float]] = SingleFlight()  # one per bucket
        # The store's bucket as the last take from it left it: (tokens left, time.monotonic() then).
        self._seen: dict[str, tuple[float, float]] = {}

    async def spend(self, bucket: str, per_minute: int, amount: int, what: str) -> Allowance:
        """Spend ``amount`` of a per-minute allowance (and say what is left) or raise LimitExceeded."""
        if amount > per_minute:
            allowance = self.allowance(bucket, per_minute)
            raise LimitExceeded(
                f"{what}: Limit {per_minute}, Requested {amount}", 60.0, allowance, too_large=True
            )
        while True:
            have = self._leases.get(bucket, 0)
            if have >= amount:  # the common case: no await, so nothing can change the lease in between
                self._leases[bucket] = have - amount
                return self.allowance(bucket, per_minute)
            want = max(amount - have, math.ceil(per_minute * self._lease_fraction))  # (if it starts one)
            refill = functools.partial(self._refill, bucket, per_minute, want)
            granted, wanted, left = await self._refills.run(bucket, refill)
            held = self._leases.get(bucket, 0)
            if granted < wanted and held < amount:
                # The shared bucket is empty: another refill now would get nothing either. The wait is for
                # what this spend lacks, exactly (120 ms may be all it takes): not for the lease the refill
                # asked for, nor rounded up to a second (Retry-After rounds; retry-after-ms is exact).
                allowance = self.allowance(bucket, per_minute)
                wait = (amount - held - left) / (per_minute / 60.0)
                raise LimitExceeded(f"{what}: Limit {per_minute}", wait, allowance)
            # Else the refill got all it asked for, but spends ahead of this one (or a refill sized for a
            # smaller amount) left too little: look again, and refill again if need be.

    def debit(self, bucket: str, amount: int) -> None:
        """Charge ``amount`` that was already used (tokens an answer generated past what admission charged
        for it), never refused: this gateway's lease goes below zero, so its next spends from the bucket
        first pay it back from the store, and wait for the refill when the store has too little."""
        if amount > 0:
            self._leases[bucket] = self._leases.get(bucket, 0) - amount

    def allowance(self, bucket: str, per_minute: int) -> Allowance:
        """What this gateway's lease holds plus what the store's bucket held at the last take from it,
        refilled since at its rate; a bucket never taken from is full. No await and no store round trip: with
        several gateways, the others' takes since then are not seen (until this one's next refill)."""
        per_s = per_minute / 60.0
        seen = self._seen.get(bucket)
        if seen is None:
            stored = float(per_minute - self._leases.get(bucket, 0))
        else:
            left, at = seen
            stored = min(float(per_minute), left + (time.monotonic() - at) * per_s)
        # (A lease taken before the store refilled can add up to more than the limit: never say more.)
        exact = min(float(per_minute), self._leases.get(bucket, 0) + stored)
        # (A debit can leave it below zero: none remains, and filling up takes longer than a minute.)
        return Allowance(per_minute, max(0, int(exact)), (per_minute - exact) / per_s)

    async def _refill(self, bucket: str, per_minute: int, want: int) -> tuple[int, int, float]:
        """Take ``want`` from the store into the lease: (granted, wanted, tokens left in the store)."""
        try:
            async with asyncio.timeout(STORE_TIMEOUT_S):
                granted, _, left = await self.store.take(bucket, per_minute, per_minute / 60.0, want)
        except REDIS_FAILURES_OR_LATE:
            granted, _, left = await self._fallback.take(bucket, per_minute, per_minute / 60.0, want)
        self._leases[bucket] = self._leases.get(bucket, 0) + granted  # the lease as it is now
        self._seen[bucket] = (left, time.monotonic())
        return granted, want, left
