"""Session bindings in Redis: one key per session, value msgpack [region, engine], TTL slid by GETEX."""

from __future__ import annotations

import msgpack
from redis.asyncio import Redis

from cache.redis_keys import RedisKeys
from cache.sessions import DEFAULT_SESSION_TTL_S, SessionBinding


class RedisSessionStore:
    def __init__(
        self, redis: Redis, keys: RedisKeys | None = None, ttl_s: float = DEFAULT_SESSION_TTL_S
    ) -> None:
        self._redis = redis
        self.keys = keys or RedisKeys()
        self.ttl_s = ttl_s

    @property
    def _ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    async def get(self, tenant: str, session_id: str) -> SessionBinding | None:
        raw = await self._redis.getex(self.keys.session(tenant, session_id), px=self._ttl_ms)
        if raw is None:
            return None
        try:
            region, engine = msgpack.unpackb(raw)
            return SessionBinding(str(region), str(engine))
        except (ValueError, TypeError, msgpack.UnpackException):
            return None  # a value we did not write: treat as no binding

    async def bind(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        value = msgpack.packb([binding.region, binding.engine])
        await self._redis.set(self.keys.session(tenant, session_id), value, px=self._ttl_ms)

    async def touch(self, tenant: str, session_id: str) -> None:
        """Restart the TTL without reading (the gateway slides TTLs in the background)."""
        await self._redis.pexpire(self.keys.session(tenant, session_id), self._ttl_ms)

    async def unbind(self, tenant: str, session_id: str) -> None:
        await self._redis.delete(self.keys.session(tenant, session_id))
