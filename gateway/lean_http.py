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

The edge (``gateway.edge``, an ``Edge`` every connection shares): a request's line and headers must arrive
within ``header_timeout_s`` of its first byte and its body at ``body_min_rate`` after ``body_timeout_s``, or
it gets a 408 and the connection closes; a connection with nothing in progress closes after
``idle_timeout_s``. One timer per connection does all of it, lazily: it fires at the earliest deadline it was
armed for and re-arms itself for the deadline of whatever the connection is doing by then, so a busy
keep-alive connection costs no timer operation per request. The edge's ``ConnectionLimits`` admits each
connection here (or refuses it past a cap with a 503 on accept), and bodies being read count against its
body budget. With authentication on, a
request's key is checked once its headers are here, before its body is read: a refused request never has
its body buffered (it is read and dropped, as a body over the size limit is), and the caller found is
handed to the handler (``LeanRequest.caller``). ``gateway.server`` applies the same deadlines and caps to
the connections aiohttp serves.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Coroutine, Generator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.edge import Edge, Identify
from gateway.errors import GatewayError, InvalidRequest, PayloadTooLarge, RequestTimedOut, Unavailable
from gateway.http_wire import head, whole_response

if TYPE_CHECKING:
    from gateway.billing import Caller

log = logging.getLogger("kvgate.lean_http")

MAX_HEADER_BYTES = 8190  # per header line, as aiohttp; larger requests go to aiohttp, which answers 431
MAX_HEAD_BYTES = 64 * 1024  # request line and all headers together
MAX_HEADERS = 128  # as aiohttp
BACKLOG_PAUSE_BYTES = 1 << 20  # pipelined bytes held while a request is answered, before reading pauses
LINGER_S, LINGER_MAX_BYTES = 10.0, 64 << 20  # how long and how much of a refused body is read and dropped

# What a connection is reading, for its deadline (LeanConnection._deadline).
_IDLE, _HEAD, _BODY, _LINGER = 0, 1, 2, 3
_NEVER = float("inf")

_T = TypeVar("_T")

# A handler of a hot endpoint: the request -> the whole answer (web.Response) or a finished LeanStream.
LeanHandler = Callable[["LeanRequest"], Awaitable[web.StreamResponse]]


class LeanRequest:
    """What the gateway's handlers read of a request: headers, the peer's address and the body; and, with
    authentication on, its ``caller``, identified before the body was read (the look-up still under way
    when the body was complete first)."""

    __slots__ = ("_body", "_connection", "caller", "headers", "method", "path", "remote")

    def __init__(
        self,
        connection: LeanConnection,
        path: str,
        headers: CIMultiDictProxy[str],
        body: bytes,
        remote: str | None,
        caller: Caller | asyncio.Task[Caller] | None = None,
    ) -> None:
        self._connection = connection
        self.method = "POST"
        self.path = path
        self.headers = headers
        self._body = body
        self.remote = remote
        self.caller = caller

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
        self._connection.write(head(self, b"Transfer-Encoding: chunked\r\n"))

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
        self._reading = _IDLE
        self._idle_since = 0.0
        self._served = False  # a whole request has been read on this connection
        self._began = 0.0  # the request's first byte
        self._body_began = 0.0  # the end of its headers
        self._linger_until = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = _NEVER

    # -- asyncio.Protocol ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._client = self._edge.limits.admit(transport, peer)
        if self._client is None:
            self._stopped = True  # refused: answered and closing; nothing it sends is read
            return
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        self._remote = str(peer[0]) if isinstance(peer, tuple | list) and peer else None
        self._registry.add(self)
        self._idle_since = self._loop.time()
        self._arm(self._idle_since + self._edge.header_s)  # a new connection owes its first request soon

    def connection_lost(self, exc: Exception | None) -> None:
        self._registry.discard(self)
        self.transport = None
        self._release_body()
        if self._client is not None:
            self._edge.limits.release(self._client)
            self._client = None
        self._queue.clear()
        self._disarm()
        if self._verdict is not None:
            self._verdict.cancel()
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
        if self._stopped:
            if self._handing_off and self._raw is not None:
                self._raw.append(data)  # aiohttp reads it after the hand-off
                self._raw_bytes += len(data)
                self._pause_if_backlogged()
            return
        if self._raw is not None:
            self._raw.append(data)
            self._raw_bytes += len(data)
        self._chunk, self._chunk_fresh = data, True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:  # a callback's _Stop, an upgrade, or a malformed request
            self._stop(exc)
            return
        finally:
            self._chunk = b""  # not kept: a connection that then idles or stalls would hold up to a read
        if self._raw is not None and self._raw_bytes > MAX_HEAD_BYTES:
            self._stop(None)  # a head without end: aiohttp refuses it its own way

    def eof_received(self) -> bool:
        return False  # close the transport

    # -- httptools callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._release_body()
        self._body = []
        self._body_bytes = 0
        self._handler = None
        self._caller = None
        if self._chunk_fresh:
            self._raw, self._raw_bytes = [self._chunk], len(self._chunk)
        else:
            self._raw = None
        self._reading = _HEAD
        self._began = self._loop.time()
        self._arm(self._began + self._edge.header_s)  # (mostly a no-op: an earlier timer re-arms itself)

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
        self._reading = _BODY
        self._body_began = self._loop.time()
        length = self._header("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            self._refuse_body(
                PayloadTooLarge(f"request body of {length} bytes exceeds the {self._max_body}-byte limit")
            )
            return
        if self._edge.identify is not None and not self._identify(self._edge.identify, expect is not None):
            return  # refused, or the key's verdict is on its way (and the 100 Continue with it)
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
        edge = self._edge
        if edge.buffered + len(body) > edge.body_budget:
            edge.limits.note_refused("body_budget")
            self._refuse_body(
                Unavailable(
                    "the gateway is reading too many request bodies at once; retry shortly",
                    code="server_busy",
                    headers={"Retry-After": "1"},
                )
            )
            return
        edge.buffered += len(body)
        self._held += len(body)
        self._body.append(body)

    def _release_body(self) -> None:
        """The body being read is whole (now a request's) or dropped: out of the edge's body budget."""
        self._edge.buffered -= self._held
        self._held = 0

    def on_message_complete(self) -> None:
        self._chunk_fresh = False
        self._reading = _IDLE
        self._served = True
        if self._discarding:
            raise _Stop  # the refused body is all read: nothing more is parsed on this connection
        handler = self._handler
        if handler is None:
            return
        self._release_body()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        caller: Caller | asyncio.Task[Caller] | None = self._caller
        if self._verdict_parsing and self._verdict is not None:
            caller = self._verdict  # the body came whole before the key's verdict: the handler awaits it
            self._verdict_parsing = self._continue_pending = False
        request = LeanRequest(self, self._path(), headers, body, self._remote, caller)
        self._queue.append((handler, request, self._parser.should_keep_alive()))
        self._queued_bytes += len(body)
        if self._task is None:
            self._task = self._loop.create_task(self._answer_queue())
        else:
            self._pause_if_backlogged()

    def _refuse_body(self, error: GatewayError) -> None:
        """Refuse the request whose headers are read (body too large, key refused), but read its body on
        (dropping it) before closing: a client still sending when the connection closes gets a reset, not
        the answer."""
        self._refusal = (self._path(), error)
        self._discarding = 1
        self._release_body()
        self._body = []
        if self._task is None:
            self._send_refusal()

    def _path(self) -> str:
        return self._url.partition(b"?")[0].decode("latin-1")

    def _header(self, name: str) -> str | None:
        return next((v for k, v in self._headers if k.lower() == name), None)

    # -- the key, before the body ----------------------------------------------------------------------

    def _identify(self, identify: Identify, expects_continue: bool) -> bool:
        """Check the key of the request whose headers are read. True: good, and known at once (a cached
        key); False: refused (its body will be dropped), or the verdict is on its way: reading pauses until
        it comes, so that at most the rest of the read in hand is buffered meanwhile."""
        authorization = self._header("authorization")
        coroutine = identify(authorization)
        try:
            awaited = coroutine.send(None)  # as far as it goes without waiting
        except StopIteration as done:
            self._caller = done.value
            return True
        except GatewayError as exc:
            # Kept without its traceback, whose frames would hold this read's bytes as long as the connection.
            self._refuse_body(exc.with_traceback(None))
            return False
        except Exception:
            # It could not even start outside a task (asyncio.timeout needs one): identify in a task.
            log.debug("identifying in a task", exc_info=True)
            verdict = self._loop.create_task(identify(authorization))
        else:
            verdict = self._loop.create_task(_carry_on(coroutine, awaited))
        self._verdict, self._verdict_parsing, self._continue_pending = verdict, True, expects_continue
        verdict.add_done_callback(self._on_verdict)
        self._hold_reading()
        return False

    def _on_verdict(self, verdict: asyncio.Task[Caller]) -> None:
        cancelled = verdict.cancelled()
        error = None if cancelled else verdict.exception()  # (retrieved here: its handler may never run)
        if verdict is not self._verdict or self.transport is None:
            return  # an earlier request's: its handler awaits it
        parsing, expects_continue = self._verdict_parsing, self._continue_pending
        self._verdict, self._verdict_parsing, self._continue_pending = None, False, False
        if parsing and not cancelled:
            if error is None:
                self._caller = verdict.result()
                if expects_continue and not self._queue and self._task is None:
                    self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            elif isinstance(error, GatewayError):
                self._refuse_body(error.with_traceback(None))  # (kept as long as the connection)
            else:
                log.error("identifying a request failed", exc_info=error)  # its handler identifies again
        self._release_reading()

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
        self._backlogged = False
        self._release_reading()
        if self._handing_off:
            self._hand_off(transport)
        elif self._refusal is not None:
            self._send_refusal()
        elif self._closing:
            self._close()
        else:
            self._idle_since = self._loop.time()
            self._arm(self._deadline())

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
            self._reading = _LINGER
            self._linger_until = self._loop.time() + LINGER_S
            self._arm(self._linger_until)
        else:
            self._close()

    def _stop(self, exc: BaseException | None) -> None:
        """Parsing ends on this connection: a request for aiohttp (handed over with its bytes when they are
        all here) or one refused; either way once the requests before it are answered."""
        self._stopped = True
        if self._refusal_sent:
            self._close()  # the refused body has been read
            return
        self._reading = _IDLE  # nothing more is read; what is left is answered once the queue is
        if self._refusal is None:
            if self._raw is not None:
                self._handing_off = True  # (aiohttp times the request's body from the hand-off)
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
        self._disarm()
        client, self._client = self._client, None  # its slot goes with it: aiohttp's handler releases it
        protocol = self._hand_off_factory(client or "")
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if raw:
            protocol.data_received(raw)

    def _write_whole(self, response: web.StreamResponse, keep_alive: bool) -> None:
        self.write(whole_response(response, keep_alive))

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    async def write_and_drain(self, data: bytes) -> None:
        self.write(data)
        if self._drain is not None:
            await asyncio.shield(self._drain)

    def _pause_if_backlogged(self) -> None:
        held = self._queued_bytes + (self._raw_bytes if self._raw else 0)
        if held > BACKLOG_PAUSE_BYTES:
            self._backlogged = True
            self._hold_reading()

    def _hold_reading(self) -> None:
        if self.transport is not None and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()

    def _release_reading(self) -> None:
        """Resume reading unless something still holds it. The wait was this server's doing, so the
        request being read gets its deadline afresh."""
        if (
            not self._reading_paused
            or self._backlogged
            or self._verdict is not None
            or self.transport is None
        ):
            return
        self._reading_paused = False
        self.transport.resume_reading()
        self._began = self._body_began = self._loop.time()
        self._arm(self._deadline())

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- deadlines -------------------------------------------------------------------------------------

    def _deadline(self) -> float:
        """When what the connection is doing now is overdue (``_NEVER``: while a request is answered, or
        while this server holds reading)."""
        reading = self._reading
        if reading == _IDLE:
            if self._task is not None:
                return _NEVER
            # Until its first request, a connection gets the header deadline from accept (as nginx's
            # client_header_timeout): a client that connects and sends nothing holds a slot 10 s, not 75.
            return self._idle_since + (self._edge.idle_s if self._served else self._edge.header_s)
        if reading == _LINGER:
            return self._linger_until
        if self._reading_paused:
            return _NEVER
        if reading == _HEAD:
            return self._began + self._edge.header_s
        return self._edge.body_deadline(self._body_began, self._body_bytes + self._discarding)

    def _arm(self, when: float) -> None:
        """Have the timer fire by ``when``. A timer already due earlier stays: it re-arms itself for the
        deadline in force when it fires, which spares a re-arm per request on a busy connection."""
        if self._timer_at <= when or when == _NEVER:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = None, _NEVER

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, _NEVER
        if self.transport is None:
            return
        deadline = self._deadline()
        if self._loop.time() < deadline:
            self._arm(deadline)
        elif self._reading in (_HEAD, _BODY):
            self._read_timed_out()
        else:
            self._close()  # idle past idle_timeout_s, or a refused body's linger is over

    def _read_timed_out(self) -> None:
        """The request being read is late: answer 408 once the requests before it are, then close."""
        phase = "header" if self._reading == _HEAD else "body"
        self._edge.timed_out(phase)
        self._reading = _IDLE
        self._raw = None  # answered here, never handed to aiohttp
        if self._refusal is None:
            if phase == "header":
                message = f"the request's headers did not arrive within {self._edge.header_s:g} s"
            else:
                message = (
                    f"the request body arrived too slowly (under {self._edge.body_rate:.0f} bytes/s after "
                    f"its first {self._edge.body_s:g} s)"
                )
            self._refusal = (
                self._path() if self._handler is not None else "unmatched",
                RequestTimedOut(message),
            )
        self._discarding = 0  # (a refusal already due is answered, and then the connection closes)
        self._stop(None)

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


class _CarryOn:
    """Awaiting this carries on a coroutine that was started outside any task and stopped at ``awaited``
    (a future it waits on): the task awaiting it takes over from there, as Python 3.12's eager tasks do."""

    __slots__ = ("_awaited", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, _T], awaited: Any) -> None:
        self._coroutine = coroutine
        self._awaited = awaited

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, awaited = self._coroutine, self._awaited
        while True:
            try:
                yield awaited  # the task waits on it as the coroutine would have
            except BaseException as exc:  # a cancellation: delivered where the coroutine waits
                try:
                    awaited = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    awaited = coroutine.send(None)
                except StopIteration as done:
                    return done.value


async def _carry_on(coroutine: Coroutine[Any, Any, _T], awaited: Any) -> _T:
    return cast(_T, await _CarryOn(coroutine, awaited))
