"""The gateway's in-process view of residency and sessions, following the shared state in Redis.

Routing reads only the view (dict lookups, no I/O). Writes land in the view at once and reach Redis through
the background writer; other gateways hear of them on a pub/sub channel. The single exception to "never
wait on Redis": a session id this gateway has never seen costs one Redis round trip, its claim: the first
claim of a session wins in Redis, and a gateway whose claim lost follows the winner (a conversation started
through another gateway keeps its engine; the first requests of a new session sent through two gateways at
once go to one engine). Without Redis, the view is the whole state (the embedded mode).

Sessions: every binding carries the time of the decision that made it, and after the first claim the newest
wins everywhere (Redis's conditional write, a view hearing of another gateway's binding, a rebuild after an
outage). A gateway that missed messages catches up three ways: the answer to its own writes says what Redis
holds instead; the periodic TTL slide of a binding in use says so too; and a follower that lost the channel
re-reads what it holds once it is back. Residency: Redis keeps a bounded, expiring mirror (warm starts, and
the approximate records of engines without KV events, shared between gateways), swept by one gateway at a
time. Hearing the other gateways on the channel, and catching up after losing it, is the job of
``gateway.state.state_follower``, which also holds the channel's wire format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from cache.cancelling import cancel_and_wait
from cache.events import KvEventBatch
from cache.redis_client import REDIS_FAILURES, REDIS_FAILURES_OR_LATE, AnyRedis
from cache.redis_keys import RedisKeys
from cache.residency_memory import MemoryResidencyIndex
from cache.residency_redis import DEFAULT_MAX_APPROXIMATE_PER_ENGINE, RedisResidencyIndex
from cache.sessions import MemorySessionStore, SessionBinding
from cache.sessions_redis import HeldBinding, RedisSessionStore
from gateway.state.background import BackgroundWriter
from gateway.state.state_follower import (
    APPROX,
    BATCH,
    RELEASE,
    SESSION,
    SESSIONS,
    GatewaysFollower,
    binding_fields,
)

log = logging.getLogger("kvgate.state")


class SharedState:
    def __init__(
        self,
        *,
        gateway_id: str,
        redis: AnyRedis | None = None,
        keys: RedisKeys | None = None,
        session_ttl_s: float = 3600.0,
        response_ttl_s: float | None = None,
        redis_read_timeout_s: float = 0.25,
        max_approximate_per_engine: int = DEFAULT_MAX_APPROXIMATE_PER_ENGINE,
        redis_sweep_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gateway_id = gateway_id
        # ``clock``: the view's time (expiries, TTLs); kvgate simulate gives it the simulated clock.
        self.index = MemoryResidencyIndex(clock=clock)
        # (``response_ttl_s``: how long a stored response's binding lives idle; default: a session's TTL.)
        self.sessions = MemorySessionStore(session_ttl_s, response_ttl_s=response_ttl_s, clock=clock)
        self.redis = redis
        self.keys = keys or RedisKeys()
        self.redis_index = (
            RedisResidencyIndex(redis, self.keys, max_approximate_per_engine=max_approximate_per_engine)
            if redis is not None
            else None
        )
        self.redis_sessions = (
            RedisSessionStore(redis, self.keys, session_ttl_s, response_ttl_s=response_ttl_s)
            if redis is not None
            else None
        )
        self.writer = BackgroundWriter(
            on_recovered=self._rebuild_redis,
            probe=redis.ping if redis is not None else None,
            check=self._check_marker if redis is not None else None,
        )
        self._marker: bytes | str | None = None  # the token Redis held under ``keys.marker`` when last read
        self.data_losses = 0  # times Redis was found to have lost what it held
        self._read_timeout_s = redis_read_timeout_s
        self._redis_sweep_every_s = redis_sweep_every_s
        self._sweeper: asyncio.Task[None] | None = None
        self._synced_at: dict[tuple[str, str], float] = {}
        # Claims sent to Redis and not answered yet: what the view holds once each is answered.
        self.claims: dict[tuple[str, str], asyncio.Future[SessionBinding | None]] = {}
        self._claiming: set[asyncio.Task[None]] = set()
        self.redis_errors = 0
        self.follower = GatewaysFollower(self)  # the other gateways' messages, and catching up after a break

    @property
    def resyncs(self) -> int:
        """Times the follower re-read Redis after losing the channel."""
        return self.follower.resyncs

    # -- lifecycle -------------------------------------------------------------------------------------

    async def start(self, engine_ids: Sequence[str]) -> None:
        """Warm the view from Redis (a restarted gateway does not start cold), then follow it."""
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvgate-sweeper")
        if self.redis is None:
            return
        self.writer.start()
        try:
            self._marker = await self._adopt_marker()
            await self.warm_start(engine_ids)
        except REDIS_FAILURES as exc:
            self.redis_errors += 1
            log.warning("could not warm the residency view from Redis: %s", exc)
        self.follower.start(engine_ids)

    async def stop(self) -> None:
        await self.follower.stop()
        await cancel_and_wait(*self._claiming, self._sweeper)
        self._sweeper = None
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
            self._slide_in_redis(tenant, session_id, binding)
            return binding
        if self.redis_sessions is None or self.writer.failing:
            return None  # Redis is away: don't wait on it; the session starts afresh here
        try:
            async with asyncio.timeout(self._read_timeout_s):
                binding = await self.redis_sessions.get(tenant, session_id)
        except REDIS_FAILURES_OR_LATE as exc:
            self.redis_errors += 1
            log.debug("session lookup in Redis failed: %s", exc)
            return None
        if binding is None:
            return None
        # (GETEX restarted its Redis TTL: the full TTL here too.) A binding that arrived meanwhile by
        # another way is kept if it is newer.
        self.sessions.offer_now(tenant, session_id, binding)
        self._synced_at[(tenant, session_id)] = time.monotonic()
        return self.sessions.peek_now(tenant, session_id) or binding

    def touch_session(self, tenant: str, session_id: str) -> SessionBinding | None:
        """The binding this view holds, its TTL restarted (in Redis now and then too); no I/O. A session
        the view does not hold is looked up by its claim (``bind_session(..., claim=True)``)."""
        binding = self.sessions.get_now(tenant, session_id)
        if binding is not None:
            self._slide_in_redis(tenant, session_id, binding)
        return binding

    def bind_session(
        self, tenant: str, session_id: str, binding: SessionBinding, *, claim: bool = False
    ) -> SessionBinding:
        """Claim or move a session: this gateway's decision, held here at once whatever was held, and
        written to Redis. A ``claim`` (a session the view held no binding for) is sent at once and wins only
        if Redis holds no binding: until Redis answers, ``claims`` holds a future of the binding the view
        holds afterwards (the claim, or the binding that was there first), which the requests of that
        session wait for before they go anywhere. A move is written in the background where the newest
        binding wins (a newer one there comes back here). The caller stamps ``made_at`` when it decides; an
        unstamped binding is stamped now. Returns what was bound."""
        if binding.made_at <= 0.0:
            binding = dataclasses.replace(binding, made_at=time.time())
        self.sessions.bind_now(tenant, session_id, binding)
        if self.redis_sessions is None:
            return binding
        message = msgpack.packb([SESSION, self.gateway_id, tenant, session_id, *binding_fields(binding)])
        self._synced_at[(tenant, session_id)] = time.monotonic()
        if claim and not self.writer.failing and (tenant, session_id) not in self.claims:
            self._claim(tenant, session_id, binding, message)
            return binding
        self.writer.submit(functools.partial(self._offer, tenant, session_id, binding, message))
        return binding

    def _claim(self, tenant: str, session_id: str, binding: SessionBinding, message: bytes) -> None:
        """Send a claim now (not behind the writer's backlog: requests wait for its answer), bounded by
        the read timeout; without an answer, the claim falls back to the background newest-wins write."""
        store, redis = self.redis_sessions, self.redis
        assert store is not None and redis is not None
        key = (tenant, session_id)
        answered: asyncio.Future[SessionBinding | None] = asyncio.get_running_loop().create_future()
        self.claims[key] = answered

        async def claim() -> None:
            won = False
            try:
                async with asyncio.timeout(self._read_timeout_s):
                    held = await store.claim(tenant, session_id, binding)
                won = held.binding == binding
                if not won:  # another gateway's claim came first: it holds the session here too
                    self._correct(tenant, session_id, binding, held)
            except REDIS_FAILURES_OR_LATE as exc:
                self.redis_errors += 1
                log.debug("session claim in Redis failed: %s", exc)
                self.writer.submit(functools.partial(self._offer, tenant, session_id, binding, message))
            finally:
                if self.claims.get(key) is answered:
                    del self.claims[key]
                if not answered.done():
                    answered.set_result(self.sessions.peek_now(tenant, session_id))
            if won:
                try:
                    await redis.publish(self.keys.updates_channel, message)
                except REDIS_FAILURES as exc:
                    self.redis_errors += 1
                    log.debug("could not announce a session claim: %s", exc)

        task = asyncio.create_task(claim(), name="kvgate-session-claim")
        self._claiming.add(task)
        task.add_done_callback(self._claiming.discard)

    async def _offer(self, tenant: str, session_id: str, binding: SessionBinding, message: bytes) -> None:
        """Newest wins in Redis; the others' views hear of a binding Redis took."""
        assert self.redis_sessions is not None and self.redis is not None
        held = await self.redis_sessions.offer(tenant, session_id, binding)
        if held.binding == binding:
            await self.redis.publish(self.keys.updates_channel, message)
        else:  # a newer decision (another gateway's) is in Redis: it wins here too
            self._correct(tenant, session_id, binding, held)

    def release_session(
        self, tenant: str, session_id: str, claimed: SessionBinding, previous: SessionBinding | None
    ) -> None:
        """Undo a claim (``bind_session``) whose request failed before the engine took it: wherever the
        binding held is still ``claimed`` (here, in Redis, in the views that heard of it), hold ``previous``
        again, or nothing. A binding made since the claim is left alone."""
        self.sessions.replace_if_now(tenant, session_id, claimed, previous)
        store, redis = self.redis_sessions, self.redis
        if store is None or redis is None:
            return
        message = msgpack.packb(
            [RELEASE, self.gateway_id, tenant, session_id, binding_fields(claimed),
             binding_fields(previous) if previous is not None else None]
        )  # fmt: skip

        async def write() -> None:  # after the claim's own write: the writer keeps their order
            if await store.release(tenant, session_id, claimed, previous):
                await redis.publish(self.keys.updates_channel, message)

        self.writer.submit(write)

    def _slide_in_redis(self, tenant: str, session_id: str, binding: SessionBinding) -> None:
        """Restart the Redis TTL now and then (not on every request): the view slides locally. The script
        slides only the binding held here and otherwise answers what Redis holds, which replaces it: a
        binding moved, released or expired elsewhere is corrected here although its message was missed."""
        store = self.redis_sessions
        if store is None:
            return
        key = (tenant, session_id)
        now = time.monotonic()
        if now - self._synced_at.get(key, 0.0) < store.lives.of(session_id) / 10:
            return
        if len(self._synced_at) > 1_000_000:
            self._synced_at.clear()
        self._synced_at[key] = now

        async def slide() -> None:
            held = await store.slide(tenant, session_id, binding)
            # While writes fail, Redis may lack what the rebuild after the outage will put back.
            if held.binding != binding and not self.writer.failing:
                self._correct(tenant, session_id, binding, held)

        self.writer.submit(slide)

    def _correct(self, tenant: str, session_id: str, mine: SessionBinding, held: HeldBinding) -> None:
        """Redis holds ``held`` where this view holds ``mine``: follow Redis, unless the view has moved on
        since (a decision made while the answer travelled is this gateway's newest)."""
        self.sessions.replace_if_now(tenant, session_id, mine, held.binding, held.ttl_s)

    # -- residency -------------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.index.lookup(hashes)

    def lookup_confirmed(self, hashes: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """Leading blocks each engine holds, and of those what its KV events confirmed (one walk)."""
        return self.index.lookup_confirmed(hashes)

    def held_blocks(self, engine: str) -> int:
        """How many blocks ``engine`` holds by the residency view (a count: no walk)."""
        return self.index.held_count_now(engine)

    def hold_soon(self, engine: str, hashes: Sequence[int], ttl_s: float) -> None:
        """A routing decision just sent these blocks' prefill to ``engine``: the next decisions count them
        there until its KV events confirm them (local only: the events will tell every gateway)."""
        self.index.hold_soon_now(engine, hashes, ttl_s)

    def forget_soon(self, engine: str, hashes: Sequence[int]) -> None:
        """Take back ``hold_soon`` for a request the engine never took."""
        self.index.forget_soon_now(engine, hashes)

    def record_route(self, engine: str, hashes: Sequence[int], ttl_s: float, *, share: bool) -> None:
        """Remember where a prefix was sent. ``share`` it through Redis when the engine publishes no events
        (the record is then all anyone will know); keep it local when its events will tell the truth."""
        if not hashes:
            return
        self.index.add_now(engine, hashes, ttl_s)
        if share and self.redis_index is not None and self.redis is not None:
            index, redis = self.redis_index, self.redis
            message = msgpack.packb([APPROX, self.gateway_id, engine, ttl_s, list(hashes)])

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

    # -- after an outage, or a Redis that lost its data ----------------------------------------------------

    async def _adopt_marker(self) -> bytes | str | None:
        """The marker token Redis holds, set to a new one first if it holds none."""
        assert self.redis is not None
        await self.redis.set(self.keys.marker, uuid.uuid4().hex, nx=True)
        held: bytes | str | None = await self.redis.get(self.keys.marker)
        return held

    async def _check_marker(self) -> None:
        """Run by the writer every second or so: one GET. A marker gone or replaced since this gateway read
        it means Redis lost what the gateways wrote without a write failing (FLUSHDB; a restart without
        persistence that the client's retry hid): the others' views would drop their bindings at the next
        refresh and a gateway started now would start cold, so this view is written back."""
        assert self.redis is not None
        held: bytes | str | None = await self.redis.get(self.keys.marker)
        if held is not None and held == self._marker:
            return
        if self._marker is not None:  # (None: Redis did not answer at start; nothing is known lost)
            self.data_losses += 1
            log.warning(
                "Redis lost what the gateways wrote there (flushed, or restarted without persistence): "
                "writing this gateway's session bindings and residency back. The usage ledger and the API "
                "keys stored there are not restored"
            )
            self._rebuild_redis()
        self._marker = await self._adopt_marker()

    def _rebuild_redis(self) -> None:
        """Redis is back after writes failed: put this gateway's view there again. The view never stopped
        following the engines' KV events, so it is the truth to restore. Session bindings are offered with
        their own times: one that another gateway replaced meanwhile stays replaced (and is replaced here),
        and the others' views hear of those that Redis takes."""
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
        for i in range(0, len(bindings), BATCH):
            batch = bindings[i : i + BATCH]
            self.writer.submit(functools.partial(self._rebind, batch))

    async def _rebind(self, batch: list[tuple[tuple[str, str], SessionBinding]]) -> None:
        assert self.redis_sessions is not None and self.redis is not None
        answers = await self.redis_sessions.offer_many(batch)
        taken: list[list[Any]] = []
        for ((tenant, session_id), binding), held in zip(batch, answers, strict=True):
            if held.binding == binding:
                taken.append([tenant, session_id, *binding_fields(binding)])
            else:
                self._correct(tenant, session_id, binding, held)
        if taken:
            message = msgpack.packb([SESSIONS, self.gateway_id, taken])
            await self.redis.publish(self.keys.updates_channel, message)

    # -- the sweeper -----------------------------------------------------------------------------------

    async def _sweep_forever(self) -> None:
        """Drop expired entries from the view (so that counts are of live ones), and every
        ``redis_sweep_every_s`` from the Redis mirror's per-engine sets, by one gateway at a time."""
        every_s = min(10.0, self._redis_sweep_every_s)
        swept_redis = time.monotonic()
        while True:
            await asyncio.sleep(every_s)
            self.index.sweep_now()
            self.sessions.sweep_now()
            index = self.redis_index
            now = time.monotonic()
            if index is None or self.writer.failing or now - swept_redis < self._redis_sweep_every_s:
                continue
            swept_redis = now
            sweep = functools.partial(index.sweep_shared, self._redis_sweep_every_s, self.gateway_id)
            self.writer.submit(sweep)
