"""An engine's response as ``gateway.http.upstream``'s connections deliver it: status and headers at once, the
body read whole or in batches, with backpressure on the socket and read timeouts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gateway.http.upstream_errors import UpstreamEngineDown, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from gateway.http.upstream import UpstreamConnection

_PAUSE_ABOVE = 1 << 20  # buffered, unconsumed body bytes above which the socket stops reading
_RESUME_BELOW = 1 << 16


class Response:
    """An engine's response: status and raw headers at once, the body read whole or in batches. Its
    underscore members are the side its connection (``gateway.http.upstream.UpstreamConnection``) drives."""

    __slots__ = (
        "_abort_timer",
        "_buffered",
        "_chunks",
        "_connection",
        "_error",
        "_headers",
        "_paused",
        "_waiter",
        "complete",
        "headers",
        "keep_alive",
        "last_received",
        "received_any",
        "status",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.received_any = False
        self.last_received = time.monotonic()  # of the last body bytes (or of the request, before any)
        self._headers: asyncio.Future[None] = loop.create_future()
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._connection: UpstreamConnection | None = None
        self._abort_timer: asyncio.TimerHandle | None = None

    def header(self, name: bytes) -> bytes | None:
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def _feed(self, data: bytes) -> None:
        self.received_any = True
        self.last_received = time.monotonic()
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _PAUSE_ABOVE and not self._paused and self._connection is not None:
            self._paused = True
            self._connection.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._connection = None
        self._cancel_abort_timer()  # ended in time: its connection is back in the pool, not to be aborted
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        if self.complete:
            return
        error.before_response = not self.received_any and not self._headers.done()
        self._error = error
        self._connection = None
        self._cancel_abort_timer()
        if not self._headers.done():
            self._headers.set_exception(error)
            self._headers.exception()  # mark retrieved: the caller may already have given up waiting
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _take(self) -> bytes:
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self._connection is not None:
            self._paused = False
            self._connection.resume_reading()
        return data

    async def next_batch(self, idle_timeout: float | None = None) -> bytes | None:
        """Every body byte received since the last call (waiting for some), or None once the body ended."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return None
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            timer = None
            if idle_timeout is not None:
                timer = loop.call_later(idle_timeout, expire_waiter, self._waiter)
            try:
                await self._waiter
            except UpstreamTimeout:
                self.abort()
                raise
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self._take()

    def iter_batches(self, idle_timeout: float | None = None) -> AsyncIterator[bytes]:
        """The body's batches as they come (``async for``), each wait at most ``idle_timeout``."""
        return _Batches(self, idle_timeout)

    async def read(self, idle_timeout: float | None = None) -> bytes:
        parts = []  # a plain loop: an async generator costs more than a small answer's whole read
        while (data := await self.next_batch(idle_timeout)) is not None:
            parts.append(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read_at_most(self, limit: int, idle_timeout: float | None = None) -> bytes:
        """The body, or its first ``limit + 1`` bytes when it is longer (so the caller can tell): then the
        exchange is dropped rather than the rest read, which an engine (or whatever holds its port) could
        make as long as it likes."""
        parts = []
        size = 0
        while (data := await self.next_batch(idle_timeout)) is not None:
            parts.append(data)
            size += len(data)
            if size > limit:
                self.abort()
                break
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        return body[: limit + 1]

    def engine_down(self, reason: str, quiet_s: float) -> None:
        """The engine was declared unhealthy: unless bytes arrived in the last ``quiet_s`` seconds (it is
        still answering this one), drop the exchange and fail whoever waits on it (their request fails over,
        or their stream ends), instead of waiting out a timeout on an engine known to be down."""
        if self.complete or time.monotonic() - self.last_received < quiet_s:
            return
        self.abort()
        self._fail(UpstreamEngineDown(f"engine declared unhealthy while this request waited: {reason}"))

    def abort(self) -> None:
        """Drop the exchange: the connection is closed (the engine sees a disconnect) and not reused."""
        self._cancel_abort_timer()
        if not self.complete and self._connection is not None:
            self._connection.abort()
            self._connection = None

    def abort_unless_ended_within(self, grace_s: float) -> None:
        """``abort`` in ``grace_s`` seconds unless the response ends before (its connection then goes back
        to the pool, as after any whole response)."""
        if self.complete or self._connection is None or self._abort_timer is not None:
            return
        self._abort_timer = asyncio.get_running_loop().call_later(grace_s, self.abort)

    def _cancel_abort_timer(self) -> None:
        timer, self._abort_timer = self._abort_timer, None
        if timer is not None:
            timer.cancel()


class _Batches:
    """``Response.iter_batches``: an iterator class, not an async generator, which mypyc cannot compile
    (gateway.compiled)."""

    def __init__(self, response: Response, idle_timeout: float | None) -> None:
        self._response = response
        self._idle_timeout = idle_timeout

    def __aiter__(self) -> _Batches:
        return self

    async def __anext__(self) -> bytes:
        data = await self._response.next_batch(self._idle_timeout)
        if data is None:
            raise StopAsyncIteration
        return data


def expire_waiter(waiter: asyncio.Future[None]) -> None:
    """A header or read timeout is up: fail ``waiter`` with ``UpstreamTimeout``, unless it is done."""
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("engine sent nothing within the read timeout"))
