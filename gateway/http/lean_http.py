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

The edge (``gateway.http.edge``, an ``Edge`` every connection shares): a request's line and headers must
arrive within ``header_timeout_s`` of its first byte and its body at ``body_min_rate`` after
``body_timeout_s``, or it gets a 408 and the connection closes; a connection with nothing in progress closes
after ``idle_timeout_s``. One timer per connection does all of it, lazily: it fires at the earliest deadline
it was armed for and re-arms itself for the deadline of whatever the connection is doing by then, so a busy
keep-alive connection costs no timer operation per request. The edge's ``ConnectionLimits`` admits each
connection here (or refuses it past a cap with a 503 on accept), and bodies being read count against its
body budget. With authentication on, a request's key is checked once its headers are here, before its body
is read: a refused request never has its body buffered (it is read and dropped, as a body over the size
limit is), and the caller found is handed to the handler (``LeanRequest.caller``). ``gateway.http.server``
applies the same deadlines and caps to the connections aiohttp serves.

A connection is built in layers, a module each: what it keeps and how it writes
(``gateway.http.lean_http_state``), its deadlines (``gateway.http.lean_http_deadlines``), answering, refusals
and the hand-off, with ``LeanStream`` (``gateway.http.lean_http_answering``); here, reading requests with
httptools and checking their keys (``LeanConnection``), and the request the handlers get (``LeanRequest``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.http.carry_on import carry_on
from gateway.http.edge import Identify
from gateway.http.errors import GatewayError, PayloadTooLarge, Unavailable
from gateway.http.http_wire import Answer
from gateway.http.lean_http_answering import LeanAnswering, LeanStream
from gateway.http.lean_http_state import BODY, HEAD, IDLE, StopParsing

if TYPE_CHECKING:
    from gateway.tenancy.billing import Caller

log = logging.getLogger("kvgate.lean_http")

MAX_HEADER_BYTES = 8190  # per header line, as aiohttp; larger requests go to aiohttp, which answers 431
MAX_HEAD_BYTES = 64 * 1024  # request line and all headers together
MAX_HEADERS = 128  # as aiohttp
LINGER_MAX_BYTES = 64 << 20  # how much of a refused body is read and dropped, at most

# A handler of a hot endpoint: the request -> the whole answer (web.Response) or a finished LeanStream.
LeanHandler = Callable[["LeanRequest"], Awaitable[Answer]]


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


class LeanConnection(LeanAnswering):
    """One client connection. Requests are answered one at a time in arrival order; bytes that arrive
    meanwhile are parsed (so a client that leaves is noticed at once) and pipelined requests wait in a queue.
    Once parsing stops (a request for aiohttp, or one refused), the requests before it are answered first."""

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
        except httptools.HttpParserError as exc:  # StopParsing, an upgrade, or a malformed request
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
        self._reading = HEAD
        self._began = self._loop.time()
        self._arm(self._began + self._edge.header_s)  # (mostly a no-op: an earlier timer re-arms itself)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        too_many = len(self._headers) >= MAX_HEADERS
        if too_many or len(name) + len(value) + 2 > MAX_HEADER_BYTES or self._head_bytes > MAX_HEAD_BYTES:
            raise StopParsing  # aiohttp answers 431
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
            raise StopParsing  # aiohttp's request
        self._handler = handler
        self._raw = None  # ours from here on
        self._reading = BODY
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
                raise StopParsing
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

    def on_message_complete(self) -> None:
        self._chunk_fresh = False
        self._reading = IDLE
        self._served = True
        if self._discarding:
            raise StopParsing  # the refused body is all read: nothing more is parsed on this connection
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
            verdict = self._loop.create_task(carry_on(coroutine, awaited))
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
