"""The Redis residency backend: a bounded, expiring mirror of the gateways' in-process views.

Routing never reads it: each gateway routes on its own view. Redis keeps what a view starts from (a
restarted gateway starts warm) and the approximate records of engines that publish no KV events, which
gateways share. Exact entries (from KV events) live until removed; approximate ones expire by themselves
(their block keys carry a key-level expiry), are swept from the per-engine sets by one gateway at a time,
and are capped per engine, so Redis never holds every prefix ever routed.

All writes go through one Lua script (atomic, one round trip) that executes a list of steps for one engine;
a lookup is one script call that walks the chain and stops at the first block no engine still holds.
Expiry times come from the Redis server's clock so gateways with skewed clocks agree.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from cache.events import KvEventBatch
from cache.hashing import to_hex
from cache.redis_client import AnyRedis
from cache.redis_keys import RedisKeys
from cache.residency import EngineHoldings, batch_ops

# KEYS: [1] engine set, [2] engine expiry zset, [3] seq hash, [4] the set of engines with approximate
#       entries. Block keys are ``ARGV[2] .. hex``: they share
#       the hash tag of KEYS (one Cluster slot), so building them here, not passing thousands, is safe.
# ARGV: [1] engine, [2] block key prefix, [3] seq mode (none | guard | set), [4] seq, [5] ttl ms for
#       approximate adds, [6] the most approximate entries the engine keeps (0: no cap), then steps: op, then
#       the step's hashes as one string of 16-hex-digit hashes.
#       Ops: S store exact, A add approximate, R remove, C clear, X expire.
# Returns {applied (0: a stale batch, refused), approximate entries dropped (expired, or over the cap)}.
# Set members go in and out with one variadic call per step, and the expiry zset is touched only while it
# holds something: a store or an eviction of N blocks costs N + O(1) commands, not 3N.
# Expiry: a block key that holds an exact entry is persistent; one that holds only approximate entries
# expires (PEXPIREAT) with the latest of them, so Redis forgets what no gateway refreshes, sweep or not.
# Keeping that costs a command per block stored or evicted, paid only while some engine has approximate
# entries (KEYS[4] not empty): a fleet whose engines all publish KV events pays nothing for it.
_WRITE = """
local engine, bprefix, mode, seq, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local cap = tonumber(ARGV[6])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if mode == 'guard' then
  local last = redis.call('HGET', KEYS[3], engine)
  if last and tonumber(last) >= seq then return {0, 0} end
end
if mode ~= 'none' then
  redis.call('HSET', KEYS[3], engine, seq)
else
  redis.call('HSETNX', KEYS[3], engine, -1)
end
local expiring = redis.call('ZCARD', KEYS[2]) > 0
local anywhere = expiring or redis.call('EXISTS', KEYS[4]) == 1  -- can any block key have an expiry?
local added = false
local dropped = 0
local function split(blob)
  local out = {}
  for i = 1, #blob, 16 do out[#out + 1] = string.sub(blob, i, i + 15) end
  return out
end
local function variadic(cmd, key, members)  -- in slices: unpack() has a stack limit
  for i = 1, #members, 4000 do redis.call(cmd, key, unpack(members, i, math.min(i + 3999, #members))) end
end
-- A persistent key may have lost its last exact entry: it then expires with its latest approximate one.
-- (A key with an expiry holds no exact entry, and its expiry is at least its entries': nothing to do.)
local function settle(key)
  if not anywhere or redis.call('PTTL', key) ~= -1 then return end
  local latest = 0
  for _, v in ipairs(redis.call('HVALS', key)) do
    local x = tonumber(v)
    if x == 0 then return end
    if x > latest then latest = x end
  end
  redis.call('PEXPIREAT', key, latest)
end
local function drop(hashes)
  if #hashes == 0 then return end
  for _, h in ipairs(hashes) do
    local key = bprefix .. h
    redis.call('HDEL', key, engine)
    settle(key)
  end
  variadic('SREM', KEYS[1], hashes)
  if expiring then variadic('ZREM', KEYS[2], hashes) end
end
local a = 7
while a <= #ARGV do
  local op, hashes = ARGV[a], split(ARGV[a + 1])
  a = a + 2
  if op == 'C' then
    for _, h in ipairs(redis.call('SMEMBERS', KEYS[1])) do
      local key = bprefix .. h
      redis.call('HDEL', key, engine)
      settle(key)
    end
    redis.call('DEL', KEYS[1], KEYS[2])
    expiring = false
  elseif op == 'X' then
    if expiring then
      local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
      drop(expired)
      dropped = dropped + #expired
    end
  elseif op == 'S' and #hashes > 0 then
    for _, h in ipairs(hashes) do
      local key = bprefix .. h
      redis.call('HSET', key, engine, 0)
      if anywhere then redis.call('PERSIST', key) end
    end
    variadic('SADD', KEYS[1], hashes)
    if expiring then variadic('ZREM', KEYS[2], hashes) end
  elseif op == 'A' then
    local exp = now + ttl
    anywhere = true
    for _, h in ipairs(hashes) do
      local key = bprefix .. h
      local cur = redis.call('HGET', key, engine)
      if cur ~= '0' and ((not cur) or tonumber(cur) < exp) then
        local left = redis.call('PTTL', key)
        redis.call('HSET', key, engine, exp)
        if left == -1 then
          settle(key)  -- persistent: an exact entry keeps it so (or a key written before keys expired)
        elseif left == -2 or now + left < exp then
          redis.call('PEXPIREAT', key, exp)
        end
        redis.call('SADD', KEYS[1], h)
        redis.call('ZADD', KEYS[2], exp, h)
        expiring, added = true, true
      end
    end
  elseif op == 'R' then
    drop(hashes)
  end
end
if added and cap > 0 then
  -- Bounded: beyond the cap, the entries that would expire soonest go now.
  local over = redis.call('ZCARD', KEYS[2]) - cap
  if over > 0 then
    local victims = redis.call('ZRANGE', KEYS[2], 0, over - 1)
    drop(victims)
    dropped = dropped + #victims
  end
end
if redis.call('EXISTS', KEYS[2]) == 1 then  -- (a zset emptied by ZREM no longer exists)
  redis.call('SADD', KEYS[4], engine)
else
  redis.call('SREM', KEYS[4], engine)
end
return {1, dropped}
"""

# KEYS: block keys in chain order. Returns a flat array engine, blocks held, engine, blocks held, ...
_LOOKUP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function live(v) if not v then return false end local x = tonumber(v) return x == 0 or x > now end
local alive = {}
local first = redis.call('HGETALL', KEYS[1])
for i = 1, #first, 2 do if live(first[i + 1]) then alive[#alive + 1] = first[i] end end
local out = {}
local depth = #KEYS
for k = 2, #KEYS do
  if #alive == 0 then break end
  local vals = redis.call('HMGET', KEYS[k], unpack(alive))
  local still = {}
  for i, e in ipairs(alive) do
    if live(vals[i]) then still[#still + 1] = e else out[#out + 1] = e; out[#out + 1] = k - 1 end
  end
  alive = still
end
for _, e in ipairs(alive) do out[#out + 1] = e; out[#out + 1] = depth end
return out
"""

_HOLDINGS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {redis.call('HGET', KEYS[3], ARGV[1]) or '', now,
        redis.call('SMEMBERS', KEYS[1]), redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')}
"""


DEFAULT_MAX_APPROXIMATE_PER_ENGINE = 200_000


class RedisResidencyIndex:
    """The index in Redis. Production writes it (the mirror) and reads ``holdings`` (warm starts, resyncs);
    ``longest_prefix`` serves the contract and tools, never routing, which reads the in-process view."""

    def __init__(
        self,
        redis: AnyRedis,
        keys: RedisKeys | None = None,
        *,
        max_approximate_per_engine: int = DEFAULT_MAX_APPROXIMATE_PER_ENGINE,
    ) -> None:
        self._redis = redis
        self.keys = keys or RedisKeys()
        self.max_approximate_per_engine = max_approximate_per_engine
        self._write = redis.register_script(_WRITE)
        self._lookup = redis.register_script(_LOOKUP)
        self._holdings = redis.register_script(_HOLDINGS)

    async def _run(
        self,
        engine: str,
        steps: Sequence[tuple[str, Sequence[int]]],
        *,
        seq_mode: str = "none",
        seq: int = 0,
        ttl_ms: int = 0,
    ) -> tuple[bool, int]:
        """Run ``steps`` as one script: (whether applied, how many approximate entries it dropped)."""
        k = self.keys
        keys = [k.engine_blocks(engine), k.engine_expiry(engine), k.engine_seq, k.approximate_engines]
        argv: list[Any] = [engine, k.block_prefix, seq_mode, seq, ttl_ms, self.max_approximate_per_engine]
        for op, hashes in steps:
            argv.extend((op, hex_run(hashes)))
        applied, dropped = await self._write(keys=keys, args=argv)
        return bool(applied), int(dropped)

    async def add(self, engine: str, hashes: Sequence[int], *, ttl_s: float | None = None) -> None:
        if ttl_s is None:
            await self._run(engine, [("S", hashes)])
        else:
            await self._run(engine, [("A", hashes)], ttl_ms=max(1, round(ttl_s * 1000)))

    async def remove(self, engine: str, hashes: Sequence[int]) -> None:
        await self._run(engine, [("R", hashes)])

    async def clear(self, engine: str) -> None:
        await self._run(engine, [("C", ())])

    async def apply(self, engine: str, batch: KvEventBatch) -> bool:
        code = {"add": "S", "remove": "R", "clear": "C"}
        steps = [(code[op], hashes) for op, hashes in batch_ops(batch)]
        applied, _ = await self._run(engine, steps, seq_mode="guard", seq=batch.seq)
        return applied

    async def replace(self, engine: str, hashes: Sequence[int], seq: int) -> None:
        await self._run(engine, [("C", ()), ("S", hashes)], seq_mode="set", seq=seq)

    async def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        keys = [self.keys.block(to_hex(h)) for h in hashes]
        flat = await self._lookup(keys=keys)
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def holdings(self, engine: str) -> EngineHoldings:
        k = self.keys
        seq, now_ms, members, scored = await self._holdings(
            keys=[k.engine_blocks(engine), k.engine_expiry(engine), k.engine_seq], args=[engine]
        )
        seq_text = _text(seq)
        expiring = {int(_text(scored[i]), 16): float(scored[i + 1]) for i in range(0, len(scored), 2)}
        exact = frozenset(h for h in (int(_text(m), 16) for m in members) if h not in expiring)
        approximate = {h: (exp - int(now_ms)) / 1000 for h, exp in expiring.items() if exp > int(now_ms)}
        return EngineHoldings(None if seq_text in ("", "-1") else int(seq_text), exact, approximate)

    async def engines(self) -> list[str]:
        return sorted(_text(e) for e in await self._redis.hkeys(self.keys.engine_seq))

    async def sweep(self) -> int:
        """Drop expired approximate entries from the engines' sets and expiry zsets (their block keys have
        expired by themselves already); returns how many."""
        dropped = 0
        for engine in await self.engines():
            dropped += (await self._run(engine, [("X", ())]))[1]
        return dropped

    async def sweep_shared(self, every_s: float, holder: str) -> int | None:
        """``sweep``, by one gateway per ``every_s`` however many share this Redis: the one that takes the
        lock (SET NX, expiring after ``every_s``) sweeps; None for the others."""
        ttl_ms = max(1, round(every_s * 1000))
        if not await self._redis.set(self.keys.sweep_lock, holder, nx=True, px=ttl_ms):
            return None
        return await self.sweep()


def hex_run(hashes: Sequence[int]) -> str:
    """Block hashes as one string of ``to_hex`` forms (16 hex digits each), packed in C: one script argument
    instead of one per block (a 750-block event cost 3.3 ms of client CPU as separate arguments)."""
    return struct.pack(f">{len(hashes)}Q", *hashes).hex()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
