"""Session bindings in Redis: one key per session, value msgpack [region, engine, made_at], a sliding TTL.

The first claim of a new session wins, decided in Redis: a claim is one Lua script that stores the binding
only where none is held and otherwise answers the binding held (its TTL restarted, as a read would), so two
gateways that claim one new session at the same moment agree before either sends it anywhere. Moves and
rebuilds are newest wins, decided in Redis too: a write is one Lua script that stores a binding only where
none is held or the held one is older (by ``made_at``), so a gateway rebuilding after an outage, or a write
that arrives late, can never undo a newer decision. The scripts that slide and release compare the held
binding with the caller's (engine and ``made_at``) and answer what Redis holds, so a gateway that missed a
message learns the truth from its next write. Values written before bindings were stamped ([region,
engine]) read as ``made_at`` 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from cache.redis_client import AnyRedis, run_scripts_pipelined
from cache.redis_keys import RedisKeys
from cache.sessions import DEFAULT_SESSION_TTL_S, BindingLives, SessionBinding

# Lua: the held binding's fields (cmsgpack is built into Redis's Lua); a value we did not write reads as none.
_HELD = """
local function held(raw)
  if not raw then return nil end
  local ok, v = pcall(cmsgpack.unpack, raw)
  if not ok or type(v) ~= 'table' or type(v[2]) ~= 'string' then return nil end
  return {engine = v[2], made_at = tonumber(v[3]) or 0}
end
"""

# KEYS: [1] session key. ARGV: [1] value, [2] made_at, [3] engine, [4] ttl ms.
# Returns {1} when the key holds this binding afterwards (written, or already held: its TTL restarted),
# else {0, held value, its PTTL}. A tie (same made_at, another engine) keeps the held one, so that every
# gateway converges on one answer: Redis's.
_OFFER = (
    _HELD
    + """
local cur = redis.call('GET', KEYS[1])
local h = held(cur)
local mine = tonumber(ARGV[2])
if h and h.made_at == mine and h.engine == ARGV[3] then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {1}
end
if h and h.made_at >= mine then return {0, cur, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
return {1}
"""
)

# KEYS: [1] session key. ARGV: [1] value, [2] made_at, [3] engine, [4] ttl ms.
# The first claim wins: writes the binding only where none is held. Returns {1} when the key holds this
# binding afterwards, else {0, held value, its PTTL} with the held binding's TTL restarted (the claim was a
# request of that session: it slides, as GETEX would).
_CLAIM = (
    _HELD
    + """
local cur = redis.call('GET', KEYS[1])
local h = held(cur)
if h and not (h.made_at == tonumber(ARGV[2]) and h.engine == ARGV[3]) then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return {0, cur, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
return {1}
"""
)

# KEYS: [1] session key. ARGV: [1] made_at, [2] engine, [3] ttl ms.
# Restarts the TTL only if the key holds this binding: returns {1}; else {0, held value or false, PTTL}.
_SLIDE = (
    _HELD
    + """
local cur = redis.call('GET', KEYS[1])
local h = held(cur)
if h and h.made_at == tonumber(ARGV[1]) and h.engine == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1}
end
return {0, cur or false, redis.call('PTTL', KEYS[1])}
"""
)

# KEYS: [1] session key. ARGV: [1] claimed made_at, [2] claimed engine, [3] previous value or '', [4] ttl ms.
# Undoes a claim: only if the key still holds exactly the claimed binding. Returns 1 if it did.
_RELEASE = (
    _HELD
    + """
local h = held(redis.call('GET', KEYS[1]))
if not (h and h.made_at == tonumber(ARGV[1]) and h.engine == ARGV[2]) then return 0 end
if ARGV[3] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
end
return 1
"""
)


@dataclass(frozen=True, slots=True)
class HeldBinding:
    """What Redis holds for a session after a script ran: the binding (None: none) and its life left."""

    binding: SessionBinding | None
    ttl_s: float


def encode(binding: SessionBinding) -> bytes:
    value: bytes = msgpack.packb([binding.region, binding.engine, float(binding.made_at)])
    return value


def decode(raw: bytes | str | None) -> SessionBinding | None:
    """A stored value as a binding; None for no value or one we did not write."""
    if not isinstance(raw, bytes):
        return None  # none (or a client that decodes replies: never the gateway's)
    try:
        fields = msgpack.unpackb(raw)
        if not isinstance(fields, list) or len(fields) not in (2, 3):
            return None
        made_at = float(fields[2]) if len(fields) == 3 else 0.0
        return SessionBinding(str(fields[0]), str(fields[1]), made_at)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None


class RedisSessionStore:
    def __init__(
        self,
        redis: AnyRedis,
        keys: RedisKeys | None = None,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        *,
        response_ttl_s: float | None = None,
    ) -> None:
        """``ttl_s``: a session's TTL; ``response_ttl_s``: a stored response's (default: the same)."""
        self._redis = redis
        self.keys = keys or RedisKeys()
        self.ttl_s = ttl_s
        self.lives = BindingLives(ttl_s, ttl_s if response_ttl_s is None else response_ttl_s)
        self._offer = redis.register_script(_OFFER)
        self._claim = redis.register_script(_CLAIM)
        self._slide = redis.register_script(_SLIDE)
        self._release = redis.register_script(_RELEASE)

    def _ttl_ms(self, session_id: str) -> int:
        return max(1, round(self.lives.of(session_id) * 1000))

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        raw = await self._redis.getex(self.keys.session(tenant, session_id), px=self._ttl_ms(session_id))
        return decode(raw)

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        await self.offer(tenant, session_id, binding)

    async def offer(self, tenant: str, session_id: str, binding: SessionBinding) -> HeldBinding:
        """Newest wins: write ``binding`` unless Redis holds a newer one (or a tie); returns what it holds."""
        args = self._offer_args(session_id, binding)
        reply = await self._offer(keys=self._script_keys(tenant, session_id), args=args)
        return self._held(reply, session_id, binding)

    async def claim(self, tenant: str, session_id: str, binding: SessionBinding) -> HeldBinding:
        """The first claim wins: write ``binding`` unless Redis holds a binding (whatever its time); returns
        what it holds afterwards (the held one's TTL restarted)."""
        args = self._offer_args(session_id, binding)
        reply = await self._claim(keys=self._script_keys(tenant, session_id), args=args)
        return self._held(reply, session_id, binding)

    async def offer_many(self, items: Sequence[tuple[tuple[str, str], SessionBinding]]) -> list[HeldBinding]:
        """``offer`` for many sessions, pipelined: one round trip (a rebuild after an outage)."""
        if not items:
            return []

        async def queue(pipe: Any) -> None:
            for (tenant, session_id), binding in items:
                args = self._offer_args(session_id, binding)
                await self._offer(keys=self._script_keys(tenant, session_id), args=args, client=pipe)

        replies = await run_scripts_pipelined(self._redis, [self._offer], queue)
        return [
            self._held(reply, session_id, binding)
            for reply, ((_, session_id), binding) in zip(replies, items, strict=True)
        ]

    async def slide(self, tenant: str, session_id: str, binding: SessionBinding) -> HeldBinding:
        """Restart the TTL if Redis holds ``binding``; either way, return what it holds (a binding moved or
        released by another gateway, whose message this one missed, comes back here)."""
        reply = await self._slide(
            keys=self._script_keys(tenant, session_id),
            args=[repr(float(binding.made_at)), binding.engine, self._ttl_ms(session_id)],
        )
        return self._held(reply, session_id, binding)

    async def read_many(self, sessions: Sequence[tuple[str, str]]) -> list[HeldBinding]:
        """What Redis holds for each session, without touching TTLs; pipelined (a resync)."""
        if not sessions:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for tenant, session_id in sessions:
                key = self.keys.session(tenant, session_id)
                pipe.get(key)
                pipe.pttl(key)
            replies = await pipe.execute()
        return [_held_value(replies[i], replies[i + 1]) for i in range(0, len(replies), 2)]

    async def release(
        self, tenant: str, session_id: str, claimed: SessionBinding, previous: SessionBinding | None
    ) -> bool:
        """Undo a claim: if Redis still holds exactly ``claimed``, hold ``previous`` again (None: nothing).
        Returns whether it did."""
        restored = encode(previous) if previous is not None else b""
        args: list[Any] = [repr(float(claimed.made_at)), claimed.engine, restored, self._ttl_ms(session_id)]
        return bool(await self._release(keys=self._script_keys(tenant, session_id), args=args))

    async def unbind(self, tenant: str, session_id: str) -> None:
        await self._redis.delete(self.keys.session(tenant, session_id))

    def _script_keys(self, tenant: str, session_id: str) -> list[str]:
        return [self.keys.session(tenant, session_id)]

    def _offer_args(self, session_id: str, binding: SessionBinding) -> list[Any]:
        # repr: the shortest text that reads back as the same double, so Lua compares made_at exactly.
        return [encode(binding), repr(float(binding.made_at)), binding.engine, self._ttl_ms(session_id)]

    def _held(self, reply: list[Any], session_id: str, mine: SessionBinding) -> HeldBinding:
        if int(reply[0]) == 1:
            return HeldBinding(mine, self.lives.of(session_id))
        return _held_value(reply[1] or None, reply[2])


def _held_value(raw: bytes | None, pttl_ms: int) -> HeldBinding:
    binding = decode(raw)
    if binding is None:
        return HeldBinding(None, 0.0)
    # PTTL -1 (a key written without a TTL, not by us): treat it as a full life; the caller caps it anyway.
    return HeldBinding(binding, pttl_ms / 1000 if pttl_ms >= 0 else float("inf"))
