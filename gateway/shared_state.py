"""The gateway's in-process view of residency and sessions, following the shared truth in Redis.

Routing reads only the view (dict lookups, no I/O). Writes land in the view at once and reach Redis through
the background writer; other gateways hear of them on a pub/sub channel. The single exception to "never
wait on Redis": a session id this gateway has never seen costs one Redis read, so a conversation started
through another gateway keeps its engine. Without Redis, the view is the whole state (the embedded mode).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgpack
from redis.asyncio import Redis
from redis.exceptions import RedisError

from cache.events import KvEventBatch
from cache.redis_keys import RedisKeys
from cache.residency_memory import MemoryResidencyIndex
from cache.residency_redis import RedisResidencyIndex
from cache.sessions import MemorySessionStore, SessionBinding
from cache.sessions_redis import RedisSessionStore
from gateway.background import BackgroundWriter

log = logging.getLogger("kvgate.state")

# Pub/sub message kinds
_SESSION = "s"
_APPROX = "a"


class SharedState:
    def __init__(
        self,
        *,
        gateway_id: str,
        redis: Redis | None = None,
        keys: RedisKeys | None = None,
        session_ttl_s: float = 3600.0,
        redis_read_timeout_s: float = 0.25,
    ) -> None:
        self.gateway_id = gateway_id
        self.index = MemoryResidencyIndex()
        self.sessions = MemorySessionStore(session_ttl_s)
        self.redis = redis
        self.keys = keys or RedisKeys()
        self.redis_index = RedisResidencyIndex(redis, self.keys) if redis is not None else None
        self.redis_sessions = (
            RedisSessionStore(redis, self.keys, session_ttl_s) if redis is not None else None
        )
        self.writer = BackgroundWriter(
            on_recovered=self._rebuild_redis, probe=redis.ping if redis is not None else None
        )
        self._read_timeout_s = redis_read_timeout_s
        self._follower: asyncio.Task[None] | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._synced_at: dict[tuple[str, str], float] = {}
        self.redis_errors = 0

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self, engine_ids: Sequence[str]) -> None:
        """Warm the view from Redis (a restarted gateway does not start cold), then follow it."""
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvgate-sweeper")
        if self.redis is None:
            return
        self.writer.start()
        try:
            await self.warm_start(engine_ids)
        except (RedisError, OSError) as exc:
            self.redis_errors += 1
            log.warning("could not warm the residency view from Redis: %s", exc)
        self._follower = asyncio.create_task(self._follow(), name="kvgate-follower")

    async def stop(self) -> None:
        for task in (self._follower, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._follower = self._sweeper = None
        await self.writer.stop()

    async def warm_start(self, engine_ids: Sequence[str]) -> None:
        assert self.redis_index is not None
        for engine in engine_ids:
            held = await self.redis_index.holdings(engine)
            self.index.replace_now(engine, list(held.exact), held.seq if held.seq is not None else -1)
            for h, ttl in held.approximate.items():
                self.index.add_now(engine, [h], ttl)

    # -- sessions --------------------------------------------------------------------------------------

    async def lookup_session(self, tenant: str, session_id: str) -> SessionBinding | None:
        binding = self.sessions.get_now(tenant, session_id)
        if binding is not None:
            self._slide_in_redis(tenant, session_id)
            return binding
        if self.redis_sessions is None or self.writer.failing:
            return None  # Redis is away: don't wait on it; the session starts afresh here
        try:
            async with asyncio.timeout(self._read_timeout_s):
                binding = await self.redis_sessions.get(tenant, session_id)
        except (RedisError, OSError, TimeoutError) as exc:
            self.redis_errors += 1
            log.debug("session lookup in Redis failed: %s", exc)
            return None
        if binding is not None:
            self.sessions.bind_now(tenant, session_id, binding)
            self._synced_at[(tenant, session_id)] = time.monotonic()
        return binding

    def bind_session(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        self.sessions.bind_now(tenant, session_id, binding)
        if self.redis_sessions is None:
            return
        store, redis = self.redis_sessions, self.redis
        assert redis is not None
        message = msgpack.packb(
            [_SESSION, self.gateway_id, tenant, session_id, binding.region, binding.engine]
        )

        async def write() -> None:
            await store.bind(tenant, session_id, binding)
            await redis.publish(self.keys.updates_channel, message)

        self._synced_at[(tenant, session_id)] = time.monotonic()
        self.writer.submit(write)

    def _slide_in_redis(self, tenant: str, session_id: str) -> None:
        """Restart the Redis TTL now and then (not on every request): the view slides locally."""
        store = self.redis_sessions
        if store is None:
            return
        key = (tenant, session_id)
        now = time.monotonic()
        if now - self._synced_at.get(key, 0.0) < store.ttl_s / 10:
            return
        if len(self._synced_at) > 1_000_000:
            self._synced_at.clear()
        self._synced_at[key] = now
        self.writer.submit(lambda: store.touch(tenant, session_id))

    # -- residency -------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.index.lookup(hashes)

    def record_route(self, engine: str, hashes: Sequence[int], ttl_s: float, *, share: bool) -> None:
        """Remember where a prefix was sent. ``share`` it through Redis when the engine publishes no events
        (the record is then all anyone will know); keep it local when its events will tell the truth."""
        if not hashes:
            return
        self.index.add_now(engine, hashes, ttl_s)
        if share and self.redis_index is not None and self.redis is not None:
            index, redis = self.redis_index, self.redis
            message = msgpack.packb([_APPROX, self.gateway_id, engine, ttl_s, list(hashes)])

            async def write() -> None:
                await index.add(engine, hashes, ttl_s=ttl_s)
                await redis.publish(self.keys.updates_channel, message)

            self.writer.submit(write)

    async def apply_events(self, engine: str, batch: KvEventBatch) -> bool:
        applied = self.index.apply_now(engine, batch)
        if applied and self.redis_index is not None:
            index = self.redis_index
            self.writer.submit(lambda: index.apply(engine, batch))
        return applied

    async def resync(self, engine: str, hashes: Sequence[int], seq: int) -> None:
        self.index.replace_now(engine, hashes, seq)
        if self.redis_index is not None:
            index = self.redis_index
            self.writer.submit(lambda: index.replace(engine, hashes, seq))

    # -- after an outage --------------------------------------------------------------------------------

    def _rebuild_redis(self) -> None:
        """Redis is back after writes failed: put this gateway's view there again. The view never stopped
        following the engines' KV events, so it is the truth to restore; session bindings made meanwhile
        are rewritten (the newest binding of a session wins, as it would have)."""
        redis_index, redis_sessions = self.redis_index, self.redis_sessions
        if redis_index is None or redis_sessions is None:
            return
        index = self.index

        async def restore() -> None:
            for engine in index.engines_now():
                held = await index.holdings(engine)
                if held.seq is not None:
                    await redis_index.replace(engine, list(held.exact), held.seq)
                by_ttl: dict[int, list[int]] = {}
                for h, remaining_s in held.approximate.items():
                    by_ttl.setdefault(max(1, int(remaining_s)), []).append(h)
                for ttl_s, hashes in by_ttl.items():
                    await redis_index.add(engine, hashes, ttl_s=float(ttl_s))

        self.writer.submit(restore)
        bindings = self.sessions.items_now()

        async def rebind() -> None:
            for (tenant, session_id), binding in bindings:
                await redis_sessions.bind(tenant, session_id, binding)

        self.writer.submit(rebind)

    # -- following the other gateways ------------------------------------------------------------------

    def _on_update(self, raw: bytes) -> None:
        try:
            message: list[Any] = msgpack.unpackb(raw)
            kind, source = message[0], message[1]
        except (ValueError, TypeError, IndexError, msgpack.UnpackException):
            return
        if source == self.gateway_id:
            return
        if kind == _SESSION and len(message) == 6:
            _, _, tenant, session_id, region, engine = message
            self.sessions.bind_now(tenant, session_id, SessionBinding(region, engine))
        elif kind == _APPROX and len(message) == 5:
            _, _, engine, ttl_s, hashes = message
            self.index.add_now(engine, hashes, float(ttl_s))

    async def _follow(self) -> None:
        assert self.redis is not None
        backoff = 0.5
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.keys.updates_channel)
                backoff = 0.5
                async for item in pubsub.listen():
                    if item.get("type") == "message":
                        self._on_update(item["data"])
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.redis_errors += 1
                log.warning("lost the Redis updates channel (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def _sweep_forever(self, every_s: float = 10.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.index.sweep_now()
