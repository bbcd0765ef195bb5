"""A lean HTTP/1.1 connection's state, and the primitives its parts share: writing with flow control, the
request's path and headers, its place in the edge's body budget. ``gateway.http.lean_http`` is the
connection."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import httptools

from gateway.http.edge import Edge
from gateway.http.errors import GatewayError

if TYPE_CHECKING:
    from gateway.http.lean_http import LeanConnection, LeanHandler, LeanRequest
    from gateway.tenancy.billing import Caller

# What a connection is reading, for its deadline (gateway.http.lean_http_deadlines).
IDLE, HEAD, BODY, LINGER = 0, 1, 2, 3
NEVER = float("inf")


class StopParsing(Exception):
    """Raised inside the parser's callbacks to stop parsing this connection."""


class LeanConnectionState(asyncio.Protocol):
    """Everything a lean connection keeps, in one place; its deadlines, its answering and its reading are
    the layers above (``LeanDeadlines``, ``LeanAnswering``, ``LeanConnection``)."""

    def __init__(
        self,
        routes: Mapping[str, LeanHandler],
        *,
        max_body_bytes: int,
        hand_off: Callable[[str], asyncio.Protocol],
        registry: set[LeanConnection],
        answered: Callable[[str, int], None],
        edge: Edge,
    ) -> None:
        self._routes = routes
        self._max_body = max_body_bytes
        self._hand_off_factory = hand_off  # given the connection's client key: its slot moves to aiohttp
        self._registry = registry
        self._answered = answered
        self._edge = edge
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._client: str | None = None  # the slot ConnectionLimits gave it (None: refused, or handed on)
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._held = 0  # of _body's bytes, counted in the edge's body budget
        self._body_bytes = 0
        self._handler: LeanHandler | None = None
        self._caller: Caller | None = None  # identified before its body was read
        # Every chunk read since the request being parsed began, while it may still go to aiohttp (None
        # once it is ours, or when it began in the middle of a read and cannot be handed over).
        self._raw: list[bytes] | None = None
        self._raw_bytes = 0
        self._chunk = b""
        self._chunk_fresh = False  # no request has ended yet in the chunk being parsed
        # Parsing stopped: hand the connection to aiohttp, or answer a refusal, once the queue is answered.
        self._stopped = False
        self._handing_off = False
        self._refusal: tuple[str, GatewayError] | None = None
        self._refusal_sent = False
        self._discarding = 0  # > 0: the body of a refused request is read and dropped, this many bytes so far
        # Answering.
        self._queue: collections.deque[tuple[LeanHandler, LeanRequest, bool]] = collections.deque()
        self._queued_bytes = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # close once the queue is answered
        self._drain: asyncio.Future[None] | None = None
        # Reading is paused while too much is held (backlogged) or while a key is being checked (verdict).
        self._reading_paused = False
        self._backlogged = False
        self._verdict: asyncio.Task[Caller] | None = None  # the key check of the request being parsed last
        self._verdict_parsing = False  # ... and that request is still being parsed
        self._continue_pending = False  # its Expect: 100-continue, answered once its key is good
        # The deadline (see _deadline): what is being read, since when.
        self._reading = IDLE
        self._idle_since = 0.0
        self._served = False  # a whole request has been read on this connection
        self._began = 0.0  # the request's first byte
        self._body_began = 0.0  # the end of its headers
        self._linger_until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = NEVER

    # -- writing ---------------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def write_and_drain(self, data: bytes) -> None:
        self.write(data)
        if self._drain is not None:
            await asyncio.shield(self._drain)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- the request being read ------------------------------------------------------------------------

    def _release_body(self) -> None:
        """The body being read is whole (now a request's) or dropped: out of the edge's body budget."""
        self._edge.buffered -= self._held
        self._held = 0

    def _path(self) -> str:
        return self._url.partition(b"?")[0].decode("latin-1")

    def _header(self, name: str) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name), None)
