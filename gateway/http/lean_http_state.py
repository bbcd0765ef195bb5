"""A lean HTTP/1.1 connection's state, and the primitives its parts share: writing with flow control, the
request's path and headers, its place in the edge's body budget. ``gateway.http.lean_http`` is the
connection."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote

import httptools

from gateway.http.edge import Edge
from gateway.http.errors import GatewayError
from gateway.http.http_wire import Buffer
from gateway.http.lean_routes import UNMATCHED, Found, Routes

if TYPE_CHECKING:
    from gateway.http.lean_http import LeanConnection
    from gateway.http.lean_request import LeanRequest
    from gateway.tenancy.billing import Caller

# What a connection is reading, for its deadline (gateway.http.lean_http_deadlines).
IDLE, HEAD, BODY, LINGER = 0, 1, 2, 3
NEVER = float("inf")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class StopParsing(Exception):
    """Raised inside the parser's callbacks to stop parsing this connection."""


class LeanConnectionState(asyncio.Protocol):
    """Everything a lean connection keeps, in one place; its deadlines, its answering and its reading are
    the layers above (``LeanDeadlines``, ``LeanAnswering``, ``LeanConnection``)."""

    def __init__(
        self,
        routes: Routes,
        *,
        max_body_bytes: int,
        registry: set[LeanConnection],
        answered: Callable[[str, int], None],
        edge: Edge,
    ) -> None:
        self._routes = routes
        self._max_body = max_body_bytes
        self._registry = registry
        self._answered = answered
        self._edge = edge
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._client: str | None = None  # the slot ConnectionLimits gave it (None: refused)
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._head_fed = 0  # bytes read while its head was being read (httptools buffers a header whole)
        self._framing_fed = 0  # bytes read in its body since the last body byte (chunk lines, trailers)
        self._body: list[bytes | bytearray] = []  # its pieces; small ones coalesced (LeanConnection.on_body)
        self._held = 0  # of _body's bytes, counted in the edge's body budget
        self._body_bytes = 0
        self._method = "GET"
        self._version = "1.1"
        self._keep_alive: bool | None = None  # None: as the parser says
        self._upgrade_body_left = 0  # bytes of an Upgrade request's body still to read (httptools won't)
        self._found: Found | None = None  # its route, once its headers are in
        self._request_path = ""
        self._caller: Caller | None = None  # identified before its body was read
        # Parsing stopped: answer a refusal (or, after an Upgrade, nothing more) once the queue is answered.
        self._stopped = False
        self._dropped = 0  # bytes read and dropped since parsing stopped
        self._unparsed = False  # parsing stopped inside a request: the rest of what comes is not read
        self._refusal: tuple[str, GatewayError] | None = None
        self._refusal_sent = False
        self._discarding = 0  # > 0: the body of a refused request is read and dropped, this many bytes so far
        # Answering.
        self._queue: collections.deque[tuple[Found, LeanRequest]] = collections.deque()
        self._queued_bytes = 0
        # What was read while the queue was full, parsed once it has been answered (gateway.http.lean_http).
        self._parked: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # close once the queue is answered
        self._drain: asyncio.Future[None] | None = None
        # Reading is paused while too much is held (backlogged) or while a key is being checked (verdict).
        self._reading_paused = False
        self._backlogged = False
        self._verdict: asyncio.Task[Caller] | None = None  # the key check of the request being parsed last
        self._verdict_parsing = False  # ... and that request is still being parsed
        self._continue_pending = False  # its Expect: 100-continue, answered once its key is good
        # An Expect: 100-continue come while earlier requests were answered: its 100 follows their answers.
        self._continue_owed = False
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

    def write(self, data: bytes | list[Buffer]) -> None:
        """Write ``data``: bytes, or parts written one after the other as they are (a large answer's)."""
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if isinstance(data, bytes):
            self.transport.write(data)
        else:
            self.transport.writelines(data)

    async def write_and_drain(self, data: bytes) -> None:
        self.write(data)
        await self.drained()

    async def drained(self) -> None:
        """Return once the transport takes writes again. A client that reads nothing of its answers for
        ``idle_timeout_s`` is gone as far as this server is concerned (nginx's send_timeout): closed, and
        ConnectionResetError raised, so that its handler stops and accounts for what it sent."""
        drain = self._drain
        if drain is None:
            return
        try:
            async with asyncio.timeout(self._edge.idle_s):
                await asyncio.shield(drain)
        except TimeoutError:
            self._edge.timed_out("write")
            if self.transport is not None:
                self.transport.abort()  # (its buffered answers are not worth sending any more)
            raise ConnectionResetError("the client read nothing of its answers for idle_timeout_s") from None

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- the request being read ------------------------------------------------------------------------

    def _release_body(self) -> None:
        """The body being read is whole (now a request's) or dropped: out of the edge's body budget."""
        self._edge.buffered -= self._held
        self._held = 0

    def _endpoint(self) -> str:
        """The metrics label of the request being read: its route's, once its headers are in."""
        found = self._found
        return found.endpoint if found is not None else UNMATCHED

    def _path(self) -> str:
        """The request target's path, percent-decoded as aiohttp's ``request.path`` is (absolute-form, a
        proxy's ``http://host/path``, included)."""
        url = self._url
        if url[:1] != b"/":
            try:
                url = httptools.parse_url(url).path or b"/"
            except httptools.HttpParserInvalidURLError:
                return url.decode("latin-1")  # no route has it: a 404
        path = url.partition(b"?")[0].partition(b"#")[0].decode("latin-1")
        return unquote(path, errors="surrogateescape") if "%" in path else path

    def _header(self, name: str) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name), None)
