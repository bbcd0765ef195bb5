"""The engine side of contract 3: numbering KV event batches and serving them over HTTP.

:class:`KvEventPublisher` turns each list of events into a :class:`cache.events.KvEventBatch` with the next
``seq``, keeps the recent batches in a ring buffer for consumers that reconnect, tracks the stored block set
so a snapshot always matches a ``seq``, and streams batches to subscribers:

- ``GET /v1/kv_snapshot`` → msgpack :class:`cache.events.KvSnapshot`, its ``seq`` also in ``x-kv-seq``.
- ``GET /v1/kv_events?after=N`` → a chunked stream of msgpack batch maps with ``seq > N``, backlog first,
  then live; a msgpack nil (0xc0) is a heartbeat. 410 Gone when the batches after ``N`` have left the ring
  (or ``N`` is ahead of this engine, i.e. it restarted): the consumer re-snapshots. 503 once the app's
  shutdown has begun (its ``on_shutdown`` ends the open streams; a new one would hold the server's stop).

Both carry ``x-kv-epoch``, random per publisher: seqs restart at 1 with the engine, so a consumer resuming
with ``&epoch=E`` from a snapshot of an earlier life of the engine gets 410 instead of batches numbered in
another life (an optional extension; without it only ``N`` > the current seq is detected).

Not thread-safe: call :meth:`KvEventPublisher.publish` on the event loop's thread (an engine whose scheduler
runs in another thread hands events over with ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Iterable

from aiohttp import web

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch, KvSnapshot

MSGPACK_CONTENT_TYPE = "application/msgpack"
STREAM_CONTENT_TYPE = "application/x-msgpack-stream"
HEARTBEAT = b"\xc0"  # msgpack nil
SEQ_HEADER = "x-kv-seq"
EPOCH_HEADER = "x-kv-epoch"

DEFAULT_RING_SIZE = 4096
DEFAULT_QUEUE_LIMIT = 8192
DEFAULT_HEARTBEAT_S = 5.0


class GoneError(Exception):
    """The batches a consumer asked for are no longer (or not yet) here: it must resync from a snapshot."""


class Subscription:
    """One live consumer: a bounded queue of encoded batches that the publisher fills and a stream drains."""

    __slots__ = ("_publisher", "_wake", "closed", "dropped", "limit", "queue", "transport", "writing")

    def __init__(self, publisher: KvEventPublisher, limit: int) -> None:
        self._publisher = publisher
        self._wake = asyncio.Event()
        self.queue: deque[bytes] = deque()
        self.limit = limit
        self.closed = False
        self.dropped = False  # overflowed: the consumer was too slow and must reconnect
        self.writing = False
        self.transport: asyncio.Transport | None = None

    def _push(self, payload: bytes) -> bool:
        if len(self.queue) >= self.limit:
            return False
        self.queue.append(payload)
        self._wake.set()
        return True

    def _drop(self) -> None:
        self.dropped = True
        self.queue.clear()  # free the memory now; the consumer resyncs anyway
        self._close()
        # A stream blocked in a write to a consumer that stopped reading never wakes up by itself.
        if self.writing and self.transport is not None:
            self.transport.abort()

    def _close(self) -> None:
        self.closed = True
        self._wake.set()

    def close(self) -> None:
        """Stop receiving; the stream ends once what is queued has been written."""
        self._publisher._unsubscribe(self)
        self._close()

    async def next_chunk(self, idle_s: float) -> bytes | None:
        """Everything queued, as one byte string; ``b""`` after ``idle_s`` of silence; None once closed."""
        if not self.queue and not self.closed:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(idle_s):
                    await self._wake.wait()
        if self.queue:
            data = b"".join(self.queue)
            self.queue.clear()
            return data
        return None if self.closed else b""


class KvEventPublisher:
    """Numbers, remembers and fans out the KV event batches of one engine."""

    def __init__(
        self,
        engine_id: str,
        block_size: int,
        *,
        ring_size: int = DEFAULT_RING_SIZE,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
    ) -> None:
        if ring_size < 1 or queue_limit < 1 or heartbeat_s <= 0:
            raise ValueError("ring_size and queue_limit must be >= 1 and heartbeat_s > 0")
        self.engine_id = engine_id
        self.block_size = block_size
        self.heartbeat_s = heartbeat_s
        self.queue_limit = queue_limit
        self._seq = 0  # 0: nothing published yet
        self.epoch = os.urandom(8).hex()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._hashes: set[int] = set()
        self._subscribers: set[Subscription] = set()
        self.stopping = False  # the app's shutdown has begun: no new streams

    @property
    def seq(self) -> int:
        """The seq of the last published batch (0 before the first)."""
        return self._seq

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    @property
    def block_count(self) -> int:
        return len(self._hashes)

    def publish(self, events: Iterable[KvEvent]) -> KvEventBatch | None:
        """Publish ``events`` as the next batch; returns it, or None when there was nothing to publish."""
        evs = tuple(events)
        if not evs:
            return None
        for event in evs:
            if isinstance(event, BlockStored):
                self._hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllCleared):
                self._hashes.clear()
        self._seq += 1
        batch = KvEventBatch(self.engine_id, self._seq, time.time(), evs)
        payload = batch.encode()  # once, however many subscribers
        self._ring.append((batch.seq, payload))
        overflowed = [sub for sub in self._subscribers if not sub._push(payload)]
        for sub in overflowed:
            self._subscribers.discard(sub)
            sub._drop()
        return batch

    def snapshot(self) -> KvSnapshot:
        """Every stored block as of :attr:`seq` (events are applied as they are published)."""
        return KvSnapshot(self.engine_id, self._seq, self.block_size, tuple(self._hashes))

    def backlog(self, after: int) -> list[bytes]:
        """The encoded batches with seq > ``after``; raises :class:`GoneError` if some are not in the ring."""
        if after < 0 or after > self._seq:
            # Ahead of us: this engine restarted and its seq began again; the consumer's view is stale.
            raise GoneError(f"seq {after} is not a seq of this engine (last is {self._seq})")
        if after == self._seq:
            return []
        oldest = self._ring[0][0] if self._ring else self._seq + 1
        if after + 1 < oldest:
            raise GoneError(f"batches after seq {after} are gone; the oldest kept is {oldest}")
        return [payload for seq, payload in self._ring if seq > after]

    def subscribe(self, after: int) -> tuple[list[bytes], Subscription]:
        """The backlog after ``after`` and a subscription for what follows, with nothing lost in between."""
        backlog = self.backlog(after)
        sub = Subscription(self, self.queue_limit)
        self._subscribers.add(sub)
        return backlog, sub

    def _unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def close_all(self) -> None:
        """End every stream (on shutdown, so open streams do not hold the server's graceful stop)."""
        for sub in list(self._subscribers):
            sub.close()

    # ------------------------------------------------------------------------------------------ HTTP

    def add_routes(self, app: web.Application) -> None:
        """Serve ``/v1/kv_snapshot`` and ``/v1/kv_events`` from ``app``; streams end on app shutdown."""
        app.router.add_get("/v1/kv_snapshot", self.handle_snapshot)
        app.router.add_get("/v1/kv_events", self.handle_events)
        app.on_shutdown.append(self._on_shutdown)

    async def _on_shutdown(self, app: web.Application) -> None:
        self.stopping = True
        self.close_all()

    def _headers(self) -> dict[str, str]:
        return {SEQ_HEADER: str(self._seq), EPOCH_HEADER: self.epoch}

    async def handle_snapshot(self, request: web.Request) -> web.Response:
        body = self.snapshot().encode()
        return web.Response(body=body, content_type=MSGPACK_CONTENT_TYPE, headers=self._headers())

    async def handle_events(self, request: web.Request) -> web.StreamResponse:
        raw = request.query.get("after")
        try:
            after = int(raw) if raw is not None else None
        except ValueError:
            after = None
        if after is None or after < 0:
            raise web.HTTPBadRequest(text="query parameter 'after' (a seq: an integer >= 0) is required")
        epoch = request.query.get("epoch")
        if epoch is not None and epoch != self.epoch:
            raise web.HTTPGone(text="the engine restarted since that seq", headers=self._headers())
        if self.stopping:
            # A request read off a keep-alive connection just before the server stopped can reach this
            # handler after _on_shutdown ended the streams. A stream opened now would be ended by nothing:
            # aiohttp waits out its shutdown_timeout for it, then again after a cancel that only reaches
            # the request body, which this handler never reads. Checked with no await before subscribe().
            raise web.HTTPServiceUnavailable(text="the engine is shutting down", headers=self._headers())
        try:
            # Subscribing before the first await guarantees no batch falls between backlog and live.
            backlog, sub = self.subscribe(after)
        except GoneError as exc:
            raise web.HTTPGone(text=str(exc), headers=self._headers()) from None
        resp = web.StreamResponse(headers=self._headers())
        resp.content_type = STREAM_CONTENT_TYPE
        resp.enable_chunked_encoding()
        sub.transport = request.transport
        try:
            await resp.prepare(request)
            # Something at once, so the consumer gets the headers now instead of at the first batch.
            chunk: bytes | None = b"".join(backlog) or HEARTBEAT
            while chunk is not None:
                sub.writing = True
                try:
                    await resp.write(chunk or HEARTBEAT)
                finally:
                    sub.writing = False
                chunk = await sub.next_chunk(self.heartbeat_s)
        except ConnectionResetError:
            pass  # the consumer went away, or we aborted it after an overflow: nobody to tell
        finally:
            sub.close()
        return resp
