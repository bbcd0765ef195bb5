"""Following the other gateways: the pub/sub channel through which a gateway's view hears of their writes.

The wire format of the updates channel lives here too (both the publishing side, ``SharedState``, and the
following side use it). A follower that loses the channel, or whose client reconnects without a word,
re-reads from Redis what it may have missed: the session bindings its view holds, and the approximate
residency entries, as a warm start does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
from redis.asyncio.connection import AbstractConnection

from cache.cancelling import cancel_and_wait
from cache.redis_client import REDIS_FAILURES
from cache.sessions import SessionBinding

if TYPE_CHECKING:
    from gateway.state.shared_state import SharedState

log = logging.getLogger("kvgate.state")

# Pub/sub message kinds. A binding travels as [region, engine, made_at].
SESSION = "s"  # [s, gateway, tenant, session id, region, engine, made_at]: a binding Redis now holds
SESSIONS = "S"  # [S, gateway, [[tenant, session id, region, engine, made_at], ...]]: a rebuild's bindings
RELEASE = "r"  # [r, gateway, tenant, session id, claimed binding, previous binding or nil]: a claim undone
APPROX = "a"  # [a, gateway, engine, ttl_s, hashes]

BATCH = 500  # sessions per pipelined round trip when rebuilding or re-reading them


def binding_fields(binding: SessionBinding) -> list[Any]:
    return [binding.region, binding.engine, binding.made_at]


def binding_from_fields(fields: Sequence[Any]) -> SessionBinding:
    """A binding from a message's [region, engine, made_at] ([region, engine]: made_at 0)."""
    made_at = float(fields[2]) if len(fields) > 2 else 0.0
    return SessionBinding(str(fields[0]), str(fields[1]), made_at)


class GatewaysFollower:
    """Applies the other gateways' messages to a ``SharedState``'s view, and re-reads Redis after a break.

    Owned by the ``SharedState`` it follows for; it reads that state's ``gateway_id``, ``redis``, ``keys``,
    ``sessions``, ``index``, ``redis_index``, ``redis_sessions`` and ``writer``, corrects bindings through
    its ``_correct``, and counts failures in its ``redis_errors``.
    """

    def __init__(self, state: SharedState) -> None:
        self._state = state
        self._engine_ids: list[str] = []
        self._follower: asyncio.Task[None] | None = None
        self._resyncing: asyncio.Task[None] | None = None
        self.resyncs = 0  # times the follower re-read Redis after losing the channel

    def start(self, engine_ids: Sequence[str]) -> None:
        self._engine_ids = list(engine_ids)
        self._follower = asyncio.create_task(self._follow(), name="kvgate-follower")

    async def stop(self) -> None:
        await cancel_and_wait(self._follower, self._resyncing)
        self._follower = self._resyncing = None

    def _on_update(self, raw: bytes) -> None:
        try:
            message: list[Any] = msgpack.unpackb(raw)
            kind, source = message[0], message[1]
            if source != self._state.gateway_id:
                self._apply_update(kind, message)
        except (ValueError, TypeError, IndexError, msgpack.UnpackException):
            return  # not a message of ours (or of a gateway too new or too old): ignore it

    def _apply_update(self, kind: str, message: list[Any]) -> None:
        sessions = self._state.sessions
        if kind == SESSION and len(message) in (6, 7):  # (6: from a gateway that did not stamp bindings)
            _, _, tenant, session_id, *fields = message
            sessions.offer_now(tenant, session_id, binding_from_fields(fields))
        elif kind == SESSIONS and len(message) == 3:
            for tenant, session_id, *fields in message[2]:
                sessions.offer_now(tenant, session_id, binding_from_fields(fields))
        elif kind == RELEASE and len(message) == 6:
            _, _, tenant, session_id, claimed, previous = message
            sessions.replace_if_now(
                tenant,
                session_id,
                binding_from_fields(claimed),
                binding_from_fields(previous) if previous else None,
            )
        elif kind == APPROX and len(message) == 5:
            _, _, engine, ttl_s, hashes = message
            self._state.index.add_now(engine, hashes, float(ttl_s))

    async def _follow(self) -> None:
        state = self._state
        assert state.redis is not None
        backoff = 0.5
        lost = False
        while True:
            pubsub = state.redis.pubsub(ignore_subscribe_messages=True)
            connection: AbstractConnection | None = None
            try:
                await pubsub.subscribe(state.keys.updates_channel)
                backoff = 0.5
                # The client reconnects and resubscribes by itself after a short break, without a word:
                # hear of it, since messages sent during the break are lost.
                connection = pubsub.connection
                if connection is not None:
                    connection.register_connect_callback(self._on_channel_reconnected)
                if lost:
                    lost = False
                    self._schedule_resync()
                async for item in pubsub.listen():
                    if item.get("type") == "message":
                        self._on_update(item["data"])
            except asyncio.CancelledError:
                raise
            except REDIS_FAILURES as exc:
                state.redis_errors += 1
                lost = True
                log.warning("lost the Redis updates channel (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
            finally:
                if connection is not None:
                    connection.deregister_connect_callback(  # type: ignore[no-untyped-call]
                        self._on_channel_reconnected
                    )
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8

    def _on_channel_reconnected(self, connection: AbstractConnection) -> None:
        """The updates channel's connection came back (and was subscribed again) after a break."""
        log.warning("the Redis updates channel reconnected; re-reading what may have been missed")
        self._schedule_resync()

    def _schedule_resync(self) -> None:
        if self._resyncing is not None:
            self._resyncing.cancel()  # a new break: start over from now
        self._resyncing = asyncio.create_task(self._resync(), name="kvgate-resync")

    async def _resync(self) -> None:
        """Catch up with what the channel's messages said while it was away: re-read from Redis the session
        bindings this view holds, and the approximate residency entries, as a warm start does."""
        state = self._state
        self.resyncs += 1
        sessions = [key for key, _ in state.sessions.items_now()]
        for i in range(0, len(sessions), BATCH):
            batch = sessions[i : i + BATCH]
            # Through the writer: this view's own writes submitted before reach Redis before the read.
            state.writer.submit(functools.partial(self._recheck, batch))
        if state.redis_index is None:
            return
        try:
            for engine in sorted(set(self._engine_ids).union(state.index.engines_now())):
                held = await state.redis_index.holdings(engine)
                for h, ttl_s in held.approximate.items():
                    state.index.add_now(engine, [h], ttl_s)  # (never downgrades an exact entry)
        except REDIS_FAILURES as exc:
            state.redis_errors += 1
            log.warning("could not re-read the residency mirror from Redis: %s", exc)

    async def _recheck(self, sessions: list[tuple[str, str]]) -> None:
        state = self._state
        assert state.redis_sessions is not None
        mine = [state.sessions.peek_now(tenant, session_id) for tenant, session_id in sessions]
        answers = await state.redis_sessions.read_many(sessions)
        # Redis is the truth, except while writes fail: it may then lack what the rebuild will put back,
        # so only newer bindings are taken from it.
        authoritative = not state.writer.failing
        for (tenant, session_id), binding, held in zip(sessions, mine, answers, strict=True):
            if binding is None or held.binding == binding:
                continue
            newer = held.binding is not None and held.binding.made_at > binding.made_at
            if authoritative or newer:
                state._correct(tenant, session_id, binding, held)
