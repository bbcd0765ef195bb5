"""A lean HTTP/1.1 server for the two hot endpoints; every other request goes to aiohttp.

aiohttp's request and response machinery is a tenth to a sixth of the CPU the gateway spends on a chat
completion (``tests/bench/bench_gateway_overhead.py`` runs a gateway without this server beside one with it).
So POSTs to ``/v1/chat/completions`` and ``/v1/completions`` over HTTP/1.1 are parsed here with httptools and
answered straight on the transport: whole answers with a Content-Length, streams with chunked encoding,
keep-alive, pipelining, ``Expect: 100-continue`` and the body size limit.

Anything else on a connection (another path or method, HTTP/1.0, an Upgrade, oversized or malformed headers)
is handed, with every byte read of it so far, to aiohttp's own connection handler, which keeps that
connection from then on: other endpoints, and the errors aiohttp gives for bad requests, behave exactly as
without this server. A hand-off needs the request's first byte to be the first byte of a read; a request
pipelined right behind another in the same read is refused with a 400 and the connection closed instead
(clients do not pipeline, and may retry on a closed connection).

The handlers are the application's own (``gateway.service``): they read a ``LeanRequest`` as they would an
aiohttp request, and stream through a ``LeanStream``, a ``web.StreamResponse`` that writes here.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from email.utils import formatdate
from typing import Any, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.errors import GatewayError, InvalidRequest, PayloadTooLarge

log = logging.getLogger("kvgate.lean_http")

MAX_HEADER_BYTES = 8190  # per header line, as aiohttp; larger requests go to aiohttp, which answers 431
MAX_HEAD_BYTES = 64 * 1024  # request line and all headers together
MAX_HEADERS = 128  # as aiohttp
KEEPALIVE_TIMEOUT_S = 75.0  # aiohttp's default for an idle keep-alive connection
BACKLOG_PAUSE_BYTES = 1 << 20  # pipelined bytes held while a request is answered, before reading pauses
LINGER_S, LINGER_MAX_BYTES = 10.0, 64 << 20  # how long and how much of a refused body is read and dropped

# A handler of a hot endpoint: the request -> the whole answer (web.Response) or a finished LeanStream.
LeanHandler = Callable[["LeanRequest"], Awaitable[web.StreamResponse]]


class LeanRequest:
    """What the gateway's handlers read of a request: headers, the peer's address and the body."""

    __slots__ = ("_body", "_connection", "headers", "method", "path", "remote")

    def __init__(
        self,
        connection: LeanConnection,
        path: str,
        headers: CIMultiDictProxy[str],
        body: bytes,
        remote: str | None,
    ) -> None:
        self._connection = connection
        self.method = "POST"
        self.path = path
        self.headers = headers
        self._body = body
        self.remote = remote

    @property
    def content_length(self) -> int:
        return len(self._body)

    async def read(self) -> bytes:
        return self._body

    def stream_response(self, headers: Mapping[str, str]) -> LeanStream:
        """A 200 stream to this request's client (``prepare``, ``write``, ``write_eof`` as aiohttp's)."""
        return LeanStream(self._connection, headers)


class LeanStream(web.StreamResponse):
    """A streamed answer written on the lean connection, in chunked encoding. Only ``prepare``, ``write``
    and ``write_eof`` are meant to be used, which is all the gateway's relay does."""

    def __init__(self, connection: LeanConnection, headers: Mapping[str, str]) -> None:
        super().__init__(status=200, headers=headers)
        self._connection = connection
        self.started = False
        self.finished = False

    async def prepare(self, request: Any) -> None:
        if self.started:
            return
        self.started = True
        self._connection.write(_head(self, b"Transfer-Encoding: chunked\r\n"))

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        await self._connection.write_and_drain(b"%x\r\n%s\r\n" % (len(data), bytes(data)))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.finished:
            return
        if data:
            await self.write(data)
        self.finished = True
        await self._connection.write_and_drain(b"0\r\n\r\n")


class _Stop(Exception):
    """Raised inside the parser's callbacks to stop parsing this connection."""


class LeanConnection(asyncio.Protocol):
    """One client connection. Requests are answered one at a time in arrival order; bytes that arrive
    meanwhile are parsed (so a client that leaves is noticed at once) and pipelined requests wait in a queue.
    Once parsing stops (a request for aiohttp, or one refused), the requests before it are answered first."""

    def __init__(
        self,
        routes: Mapping[str, LeanHandler],
        *,
        max_body_bytes: int,
        hand_off: Callable[[], asyncio.Protocol],
        registry: set[LeanConnection],
        answered: Callable[[str, int], None],
    ) -> None:
        self._routes = routes
        self._max_body = max_body_bytes
        self._hand_off_factory = hand_off
        self._registry = registry
        self._answered = answered
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._remote: str | None = None
        # The request being parsed.
        self._url = b""
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._handler: LeanHandler | None = None
        # Every chunk read since the request being parsed began, while it may still go to aiohttp (None
        # once it is ours, or when it began in the middle of a read and cannot be handed over).
        self._raw: list[bytes] | None = None
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
        self._reading_paused = False
        self._idle_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        peer = self.transport.get_extra_info("peername")
        self._remote = str(peer[0]) if isinstance(peer, tuple | list) and peer else None
        self._registry.add(self)
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._registry.discard(self)
        self.transport = None
        self._queue.clear()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # the client left: its handler stops its engine request and accounts for it
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
            self._drain.exception()  # retrieved here too: nobody may be waiting on it any more

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    def data_received(self, data: bytes) -> None:
        if self._idle_timer is not None and not self._refusal_sent:  # (after a refusal it bounds the linger)
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._stopped:
            if self._handing_off and self._raw is not None:
                self._raw.append(data)  # aiohttp reads it after the hand-off
                self._pause_if_backlogged()
            return
        if self._raw is not None:
            self._raw.append(data)
        self._chunk, self._chunk_fresh = data, True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:  # a callback's _Stop, an upgrade, or a malformed request
            self._stop(exc)
            return
        if self._raw is not None and sum(map(len, self._raw)) > MAX_HEAD_BYTES:
            self._stop(None)  # a head without end: aiohttp refuses it its own way

    def eof_received(self) -> bool:
        return False  # close the transport

    # -- httptools callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._handler = None
        self._raw = [self._chunk] if self._chunk_fresh else None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        too_many = len(self._headers) >= MAX_HEADERS
        if too_many or len(name) + len(value) + 2 > MAX_HEADER_BYTES or self._head_bytes > MAX_HEAD_BYTES:
            raise _Stop  # aiohttp answers 431
        # As aiohttp decodes them: a value that is not UTF-8 keeps its bytes as surrogates.
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        path = self._path()
        handler = self._routes.get(path)
        expect = self._header("expect")
        if (
            handler is None
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or parser.should_upgrade()
            or (expect is not None and expect.lower() != "100-continue")
        ):
            raise _Stop  # aiohttp's request
        self._handler = handler
        self._raw = None  # ours from here on
        length = self._header("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            self._refuse_body(
                PayloadTooLarge(f"request body of {length} bytes exceeds the {self._max_body}-byte limit")
            )
            return
        if expect is not None and not self._queue and self._task is None:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._discarding:
            self._discarding += len(body)
            if self._discarding > LINGER_MAX_BYTES:
                raise _Stop
            return
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body:
            self._refuse_body(PayloadTooLarge(f"request body exceeds the {self._max_body}-byte limit"))
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._chunk_fresh = False
        if self._discarding:
            raise _Stop  # the refused body is all read: nothing more is parsed on this connection
        handler = self._handler
        if handler is None:
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        request = LeanRequest(self, self._path(), headers, body, self._remote)
        self._queue.append((handler, request, self._parser.should_keep_alive()))
        self._queued_bytes += len(body)
        if self._task is None:
            self._task = self._loop.create_task(self._answer_queue())
        else:
            self._pause_if_backlogged()

    def _refuse_body(self, error: PayloadTooLarge) -> None:
        """Refuse the request whose body is too large, but read the body on (dropping it) before closing: a
        client still sending when the connection closes gets a reset, not the 413."""
        self._refusal = (self._path(), error)
        self._discarding = 1
        self._body = []
        if self._task is None:
            self._send_refusal()

    def _path(self) -> str:
        return self._url.partition(b"?")[0].decode("latin-1")

    def _header(self, name: str) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name), None)

    # -- answering -------------------------------------------------------------------------------------

    async def _answer_queue(self) -> None:
        try:
            while self._queue and self.transport is not None:
                handler, request, keep_alive = self._queue.popleft()
                self._queued_bytes -= request.content_length
                response = await handler(request)
                if isinstance(response, LeanStream):
                    if not response.finished:
                        self._close()  # a stream that did not end cleanly: the client cannot reuse it
                        return
                else:
                    keep_alive = keep_alive and not (self._closing and not self._queue)
                    self._write_whole(response, keep_alive)
                if not keep_alive:
                    self._close()
                    return
        except ConnectionResetError:
            self._close()
            return
        except Exception:
            log.exception("unhandled error while answering a request")
            self._close()
            return
        finally:
            self._task = None
        self._when_idle()

    def _when_idle(self) -> None:
        """The queue is answered: resume reading, and do what stopped parsing asked for."""
        transport = self.transport
        if transport is None:
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if self._handing_off:
            self._hand_off(transport)
        elif self._refusal is not None:
            self._send_refusal()
        elif self._closing:
            self._close()
        else:
            self._arm_idle_timer()

    def _send_refusal(self) -> None:
        """Answer the refusal (once) and close, or, while its body is still being dropped, close after that
        or after ``LINGER_S`` at the latest."""
        if self._refusal is None or self.transport is None:
            return
        if not self._refusal_sent:
            self._refusal_sent = True
            endpoint, error = self._refusal
            self._answered(endpoint, error.status)
            self._write_whole(error.response(), keep_alive=False)
        if self._discarding and not self._stopped:
            self._idle_timer = self._loop.call_later(LINGER_S, self._close)
        else:
            self._close()

    def _stop(self, exc: BaseException | None) -> None:
        """Parsing ends on this connection: a request for aiohttp (handed over with its bytes when they are
        all here) or one refused; either way once the requests before it are answered."""
        self._stopped = True
        if self._refusal_sent:
            self._close()  # the refused body has been read
            return
        if self._refusal is None:
            if self._raw is not None:
                self._handing_off = True
            else:
                reason = (
                    "a request pipelined behind another cannot be handed over; send it on its own connection"
                )
                if exc is not None and not isinstance(exc.__context__, _Stop) and self._handler is not None:
                    reason = str(exc) or type(exc).__name__
                error = InvalidRequest(f"malformed HTTP request: {reason}", code="bad_http_request")
                self._refusal = (self._path() if self._handler is not None else "unmatched", error)
        if self._task is None:
            self._when_idle()

    def _hand_off(self, transport: asyncio.Transport) -> None:
        raw = b"".join(self._raw or ())
        self._registry.discard(self)
        self.transport = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        protocol = self._hand_off_factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if raw:
            protocol.data_received(raw)

    def _write_whole(self, response: web.StreamResponse, keep_alive: bool) -> None:
        body = response.body if isinstance(response, web.Response) else None
        data = bytes(body) if isinstance(body, bytes | bytearray) else b""
        framing = [b"Content-Length: %d\r\n" % len(data)]
        if "Content-Type" not in response.headers:
            framing.append(b"Content-Type: application/octet-stream\r\n")
        if not keep_alive:
            framing.append(b"Connection: close\r\n")
        self.write(_head(response, *framing) + data)

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def write_and_drain(self, data: bytes) -> None:
        self.write(data)
        if self._drain is not None:
            await asyncio.shield(self._drain)

    def _pause_if_backlogged(self) -> None:
        held = self._queued_bytes + (sum(map(len, self._raw)) if self._raw else 0)
        if held > BACKLOG_PAUSE_BYTES and self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _arm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._idle_timer = self._loop.call_later(KEEPALIVE_TIMEOUT_S, self._close)

    # -- shutdown --------------------------------------------------------------------------------------

    def close_when_idle(self) -> None:
        """Stop taking requests: close now if idle, else once the requests read so far are answered."""
        self._closing = True
        if self._task is None:
            self._close()

    async def shutdown(self, grace_s: float | None) -> None:
        """Let the request in progress finish for ``grace_s`` seconds, then cancel it; close."""
        self.close_when_idle()
        task = self._task
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                task.cancel()
                await asyncio.wait({task})
        self._close()


_SKIPPED = frozenset({"content-length", "transfer-encoding", "connection", "date"})  # this server's to set


def _head(response: web.StreamResponse, *framing: bytes) -> bytes:
    """A response's status line and headers, with this server's framing lines, the Date and the blank line."""
    status = b"HTTP/1.1 %d %s\r\n" % (response.status, (response.reason or "").encode("latin-1"))
    headers = "".join(f"{k}: {v}\r\n" for k, v in response.headers.items() if k.lower() not in _SKIPPED)
    return b"".join((status, headers.encode("latin-1"), *framing, _date_line(), b"\r\n"))


_date: tuple[int, bytes] = (0, b"")


def _date_line() -> bytes:
    """The Date header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode("ascii"))
    return _date[1]
