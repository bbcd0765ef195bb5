"""The usage ledger in Redis: a Stream of records plus per-tenant/day counters, written by one Lua script
that first claims the record id, so a record delivered twice (a retry, a spool replay) counts once.

Record ids are remembered per day (a set per day, expiring), and one request's records may name two days: a
record takes its completion's time, an estimate replayed from the usage journal its dispatch's. So an id is
also looked for in the day before and the day after its own: a request that runs across midnight counts
once (one that runs for more than a day could still count twice; no timeout lets one run that long).

Every key carries the hash tag ``{<prefix>:ledger}``: the script's keys share a Redis Cluster slot.
"""

from __future__ import annotations

from typing import Any, cast

import msgpack

from cache.ledger import COUNTER_FIELDS, DayTotals, UsageRecord, day_name, days_between
from cache.redis_client import AnyRedis, run_scripts_pipelined

SEEN_TTL_S = 14 * 24 * 3600  # how long a record id is remembered (spools are replayed long before)
STREAM_MAXLEN = 10_000_000

# KEYS: seen set of the record's day, stream, the tenant/day counters, the day's tenant set, the seen sets
#       of the day before and the day after
# ARGV: record id, payload, tenant, prompt, cached, completion, cost in pico-dollars, seen ttl, stream maxlen
_RECORD = """
if redis.call('SISMEMBER', KEYS[5], ARGV[1]) == 1 or redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 1 then
  return 0
end
if redis.call('SADD', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('EXPIRE', KEYS[1], ARGV[8])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[9], '*', 'id', ARGV[1], 'tenant', ARGV[3], 'r', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'requests', 1)
redis.call('HINCRBY', KEYS[3], 'prompt_tokens', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'cached_tokens', ARGV[5])
redis.call('HINCRBY', KEYS[3], 'completion_tokens', ARGV[6])
redis.call('HINCRBY', KEYS[3], 'cost_picodollars', ARGV[7])
redis.call('SADD', KEYS[4], ARGV[3])
return 1
"""


class RedisLedger:
    def __init__(self, redis: AnyRedis, prefix: str = "kvgate") -> None:
        self._redis = redis
        self._tag = f"{{{prefix}:ledger}}"
        self._record = redis.register_script(_RECORD)

    def _sum_key(self, tenant: str, day: str) -> str:
        return f"{self._tag}:sum:{tenant}:{day}"

    @property
    def stream_key(self) -> str:
        return f"{self._tag}:stream"

    def _call(self, rec: UsageRecord, client: Any = None) -> Any:
        day_number = int(rec.ts // 86_400)
        keys = [f"{self._tag}:seen:{rec.day}", self.stream_key, self._sum_key(rec.tenant, rec.day),
                f"{self._tag}:tenants:{rec.day}", f"{self._tag}:seen:{day_name(day_number - 1)}",
                f"{self._tag}:seen:{day_name(day_number + 1)}"]  # fmt: skip
        args = [rec.record_id, msgpack.packb(rec.to_dict()), rec.tenant, rec.prompt_tokens, rec.cached_tokens,
                rec.completion_tokens, rec.cost_picodollars, SEEN_TTL_S, STREAM_MAXLEN]  # fmt: skip
        return self._record(keys=keys, args=args, client=client)

    async def record(self, rec: UsageRecord) -> bool:
        return bool(await self._call(rec))

    async def record_many(self, recs: list[UsageRecord]) -> int:
        """One pipeline (one round trip); each script call is still atomic on its own."""
        if len(recs) == 1:
            return int(await self.record(recs[0]))

        async def queue(pipe: Any) -> None:
            for rec in recs:
                await self._call(rec, client=pipe)

        return sum(int(r) for r in await run_scripts_pipelined(self._redis, [self._record], queue))

    async def daily(self, tenant: str, start_day: str, end_day: str) -> list[DayTotals]:
        days = days_between(start_day, end_day)
        async with self._redis.pipeline(transaction=False) as pipe:
            for day in days:
                pipe.hgetall(self._sum_key(tenant, day))
            rows = await pipe.execute()
        return [_totals(day, row) for day, row in zip(days, rows, strict=True) if row]

    async def tenants(self, start_day: str, end_day: str) -> dict[str, list[DayTotals]]:
        names: set[str] = set()
        for day in days_between(start_day, end_day):
            names.update(_text(t) for t in await self._redis.smembers(f"{self._tag}:tenants:{day}"))
        return {t: await self.daily(t, start_day, end_day) for t in sorted(names)}

    async def records(self, tenant: str | None = None, limit: int = 1000) -> list[UsageRecord]:
        out: list[UsageRecord] = []
        last = "+"
        while len(out) < limit:
            batch = await self._redis.xrevrange(self.stream_key, max=last, count=1000)
            if not batch:
                break
            entries = cast(list[tuple[bytes, dict[bytes, bytes]]], batch)
            for _, entry in entries:
                if tenant is None or _text(entry[b"tenant"]) == tenant:
                    out.append(UsageRecord.from_dict(msgpack.unpackb(entry[b"r"])))
            last = "(" + _text(entries[-1][0])
        return list(reversed(out[:limit]))


def _totals(day: str, row: dict[Any, Any]) -> DayTotals:
    values = {_text(k): int(v) for k, v in row.items()}
    return DayTotals(day, **{f: values.get(f, 0) for f in COUNTER_FIELDS})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
