"""The gateway's HTTP/1.1 server: every request on the public port (and on the operator's port) is parsed
here with httptools and answered straight on the transport.

aiohttp's request and response machinery cost a quarter more CPU per chat completion than this server
(``tests/bench/bench_gateway_overhead.py`` measured both while aiohttp still served beside it), so the
gateway serves itself: whole answers with a Content-Length, streams with chunked encoding (to HTTP/1.0
clients: unframed, then the connection closes), keep-alive (HTTP/1.0's ``Connection: keep-alive`` too),
pipelining, HEAD, ``Expect: 100-continue``, the body size limit, and for what no route answers the 404 or the
405 with ``Allow`` (``gateway.http.lean_routes``). A request the parser cannot read gets an OpenAI-shaped 400
(headers too large: 431; a request target too long: 414) after the requests before it are answered, and
the connection closes. An Upgrade (h2c, websocket) is not taken, as RFC 9110 lets a server choose: the
request is answered as HTTP/1.1 and the connection goes on.

The handlers are the application's own (``gateway.service``, ``gateway.app``): they read a ``LeanRequest``
(method, path, query, headers, body) and stream through a ``LeanStream``, a ``web.StreamResponse`` that
writes here.

The edge (``gateway.http.edge``, an ``Edge`` every connection shares): a request's line and headers must
arrive within ``header_timeout_s`` of its first byte and its body at ``body_min_rate`` after
``body_timeout_s``, or it gets a 408 and the connection closes; a connection with nothing in progress closes
after ``idle_timeout_s``. One timer per connection does all of it, lazily: it fires at the earliest deadline
it was armed for and re-arms itself for the deadline of whatever the connection is doing by then, so a busy
keep-alive connection costs no timer operation per request. The edge's ``ConnectionLimits`` admits each
connection here (or refuses it past a cap with a 503 on accept), and bodies being read count against its
body budget. With authentication on, the key of a request to a completion endpoint is checked once its
headers are here, before its body is read: a refused request never has its body buffered (it is read and
dropped, as a body over the size limit is), and the caller found is handed to the handler
(``LeanRequest.caller``).

A connection is built in layers, a module each: what it keeps and how it writes
(``gateway.http.lean_http_state``), its deadlines (``gateway.http.lean_http_deadlines``), what a request's
head is refused for (``gateway.http.lean_http_head``), answering and refusals, with ``LeanStream``
(``gateway.http.lean_http_answering``); here, reading requests with httptools
and checking their keys (``LeanConnection``). The request the handlers get is ``gateway.http.lean_request``'s.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

from gateway.http.carry_on import carry_on
from gateway.http.edge import Identify
from gateway.http.errors import GatewayError, PayloadTooLarge, Unavailable
from gateway.http.lean_http_answering import LeanAnswering
from gateway.http.lean_http_deadlines import MAX_PIPELINED
from gateway.http.lean_http_head import bad_http, head_refusal
from gateway.http.lean_http_state import BODY, CONTINUE, HEAD, IDLE, StopParsing
from gateway.http.lean_request import LeanRequest
from gateway.http.lean_routes import UNMATCHED
from gateway.http.retry_after import retry_after_headers

if TYPE_CHECKING:
    from gateway.tenancy.billing import Caller


log = logging.getLogger("kvgate.lean_http")

MAX_TARGET_BYTES = 8190  # the request target, as aiohttp's limit on a request line: past it, 414
MAX_HEADER_BYTES = 8190  # per header line, as aiohttp: past it, 431
MAX_HEAD_BYTES = 64 * 1024  # request line and all headers together: past it, 431
MAX_HEADERS = 128  # as aiohttp
LINGER_MAX_BYTES = 64 << 20  # how much of a refused body is read and dropped, at most
PARSE_SLICE_BYTES = 16 << 10  # a large read is parsed this much at a time
SMALL_PIECE_BYTES = 4096  # a body piece smaller than this is copied onto the one before it
BODY_BUDGET_RETRY_AFTER_S = 1  # bodies being read past the budget: others will have been read by then


class LeanConnection(LeanAnswering):
    """One client connection. Requests are answered one at a time in arrival order; bytes that arrive
    meanwhile are parsed (so a client that leaves is noticed at once) and pipelined requests wait in a queue.
    Once parsing stops (a request refused, or an Upgrade), the requests before it are answered first."""

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
            self._dropped += len(data)  # a refusal's lingering read, or a refused connection's
            if self._dropped > LINGER_MAX_BYTES:
                self._close()
            return
        if self._upgrade_body_left:
            self._read_upgrade_body(data)
            return
        if self._parked or len(self._queue) >= MAX_PIPELINED:
            self._park(data)
            return
        if len(data) > PARSE_SLICE_BYTES:
            self._parse_in_slices(data)
            return
        reading, progress = self._reading, self._body_bytes + self._discarding
        if reading == HEAD:
            self._head_fed += len(data)  # (the request began in an earlier read: all of this is its head)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # The Upgrade is not taken (RFC 9110 7.8: a server may ignore it): HTTP/1.1 goes on, with a
            # parser of its own, once the request's body (which httptools leaves unread) is read here.
            self._parser = httptools.HttpRequestParser(self)
            self._read_upgrade_body(data[upgrade.args[0] :])
            return
        except httptools.HttpParserError as exc:  # StopParsing, or a malformed request
            self._unparsed = not self._discarding  # (else: the end of a refused body, read and dropped)
            self._stop(exc)
            return
        if self._reading == HEAD and self._head_fed > MAX_HEAD_BYTES:
            # A head without end (httptools buffers a header until it is whole): refused, not buffered on.
            self._unparsed = True
            self._refusal = (
                UNMATCHED,
                bad_http(431, f"request headers too large (at most {MAX_HEAD_BYTES} bytes)"),
            )
            self._stop(None)
        elif reading == BODY == self._reading:
            self._bound_framing(len(data), progress)

    def _bound_framing(self, fed: int, progress: int) -> None:
        """A chunked body's framing between its data (chunk lines, the trailer section) is bounded as a head
        is: httptools keeps a trailer field whole until it ends, copying it at every read, so one sent
        forever held memory and the event loop until the body deadline. Reads that brought no body byte
        count; past MAX_HEAD_BYTES of them, 431."""
        if self._body_bytes + self._discarding != progress:
            self._framing_fed = 0
            return
        self._framing_fed += fed
        if self._framing_fed > MAX_HEAD_BYTES:
            self._unparsed = True
            if not self._discarding:
                message = f"chunk framing or trailer fields too large (at most {MAX_HEAD_BYTES} bytes)"
                self._refusal = (self._endpoint(), bad_http(431, message))
            self._stop(None)

    def eof_received(self) -> bool:
        return False  # close the transport

    def _parse_in_slices(self, data: bytes) -> None:
        """Parse a large read a slice at a time, parking the rest as soon as the queue is full (one read
        may hold thousands of small requests)."""
        for start in range(0, len(data), PARSE_SLICE_BYTES):
            if self.transport is None or self._stopped:
                return
            if self._parked or len(self._queue) >= MAX_PIPELINED:
                self._park(data[start:])
                return
            self.data_received(data[start : start + PARSE_SLICE_BYTES])

    def _park(self, data: bytes) -> None:
        """Pipelined far ahead of the answers: ``data`` waits unparsed, with reading held, so that requests
        without bodies, free to send, cannot pile up in memory by the thousand."""
        self._parked.append(data)
        self._backlogged = True
        self._hold_reading()

    def _parse_parked(self) -> None:
        """The queue has been answered: parse what waited (which may fill it, and wait, again)."""
        data = b"".join(self._parked)
        self._parked.clear()
        self.data_received(data)

    # -- httptools callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._head_fed = self._framing_fed = 0
        self._release_body()
        self._body = []
        self._body_bytes = 0
        self._keep_alive = None
        self._found = None
        self._request_path = ""
        self._caller = None
        self._continue_owed = False
        self._reading = HEAD
        self._began = self._loop.time()
        self._arm(self._began + self._edge.header_s)  # (mostly a no-op: an earlier timer re-arms itself)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if len(self._url) > MAX_TARGET_BYTES:
            self._refusal = (
                UNMATCHED,
                bad_http(414, f"request target too long (at most {MAX_TARGET_BYTES} bytes)"),
            )
            raise StopParsing

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._reading != HEAD:
            return  # a trailer field: not merged into the headers (RFC 9110 6.5.1); bounded by _bound_framing
        self._head_bytes += len(name) + len(value) + 4
        too_many = len(self._headers) >= MAX_HEADERS
        if too_many or len(name) + len(value) + 2 > MAX_HEADER_BYTES or self._head_bytes > MAX_HEAD_BYTES:
            # Said without echoing the header back: it may be a credential.
            message = (
                f"request headers too large (at most {MAX_HEADER_BYTES} bytes a line, {MAX_HEADERS} lines)"
            )
            self._refusal = (UNMATCHED, bad_http(431, message))
            raise StopParsing
        # As aiohttp decodes them: a value that is not UTF-8 keeps its bytes as surrogates.
        self._headers.append((name.decode("latin-1"), value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        self._request_path = path = self._path()
        self._method = method = parser.get_method().decode("latin-1")
        self._version = parser.get_http_version()
        self._found = found = self._routes.find(method, path)
        self._reading = BODY
        if parser.should_upgrade():
            self._upgrade_requested()
        self._body_began = self._loop.time()
        if self._version == "1.0" and self._header("transfer-encoding") is not None:
            # RFC 9112 6.1: its framing is faulty (an HTTP/1.0 hop before this one did not read it as chunked,
            # and may have sent what follows as another request): answered, then the connection closes.
            self._keep_alive = False
        refusal, expect = head_refusal(self._headers, self._version, self._max_body)
        if refusal is not None:
            self._refuse_body(refusal)
            return
        identify = self._edge.identify
        if found.key_first and identify is not None and not self._identify(identify, expect is not None):
            return  # refused, or the key's verdict is on its way (and the 100 Continue with it)
        if expect is not None:
            self._continue()

    def on_body(self, body: bytes) -> None:
        self._continue_owed = False  # (the client sent its body without waiting: no 100 is due any more)
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
                    headers=retry_after_headers(BODY_BUDGET_RETRY_AFTER_S),
                )
            )
            return
        edge.buffered += len(body)
        self._held += len(body)
        # Small pieces (a chunked body's tiny chunks) go into one bytearray: kept each as bytes, a 2-byte
        # chunk cost some 45 bytes, and a client could hold 20 times the body budget it is counted against.
        # The first piece stays as it came, so that a body read in one piece is not copied.
        pieces = self._body
        if len(body) >= SMALL_PIECE_BYTES or not pieces:
            pieces.append(body)
        elif isinstance(pieces[-1], bytearray):
            pieces[-1] += body
        else:
            pieces.append(bytearray(body))

    def on_message_complete(self) -> None:
        if self._upgrade_body_left:
            return  # an Upgrade's body, which httptools does not read: _read_upgrade_body reads it
        self._reading = IDLE
        self._served = True
        self._continue_owed = False
        if self._discarding:
            raise StopParsing  # the refused body is all read: nothing more is parsed on this connection
        self._complete()

    def _complete(self) -> None:
        """The request is whole: into the queue, answered in turn."""
        found = self._found
        if found is None:
            return
        self._release_body()
        pieces = self._body
        body = pieces[0] if len(pieces) == 1 and isinstance(pieces[0], bytes) else b"".join(pieces)
        headers = CIMultiDictProxy(CIMultiDict(self._headers))
        caller: Caller | asyncio.Task[Caller] | None = self._caller
        if self._verdict_parsing and self._verdict is not None:
            caller = self._verdict  # the body came whole before the key's verdict: the handler awaits it
            self._verdict_parsing = self._continue_pending = False
        keep_alive = self._parser.should_keep_alive() if self._keep_alive is None else self._keep_alive
        request = LeanRequest(
            self,
            self._method,
            self._request_path,
            headers,
            body,
            self._remote,
            caller,
            target=self._url,
            match_info=found.match_info,
            version=self._version,
            keep_alive=keep_alive,
        )
        self._queue.append((found, request))
        self._queued_bytes += len(body)
        if self._task is None:
            self._task = self._loop.create_task(self._answer_queue())
        else:
            self._pause_if_backlogged()

    def _continue(self) -> None:
        """Tell the client to send the body of the request whose head is read: now, or, while the requests
        before it are being answered (a 100 written now would land inside their answers), once they are
        (``LeanAnswering._when_idle``). Without the 100 a client that waits for it, as RFC 9110 10.1.1 lets
        it, sent nothing and got a 408 at the body deadline."""
        if not self._queue and self._task is None:
            self.write(CONTINUE)
        else:
            self._continue_owed = True

    # -- an Upgrade, not taken -------------------------------------------------------------------------

    def _upgrade_requested(self) -> None:
        """A request with ``Connection: upgrade`` (h2c, websocket): httptools stops after its headers and
        leaves its body unread, so a Content-Length body is read by ``_read_upgrade_body``; a chunked one is
        refused. The connection stays HTTP/1.1, kept alive as its other headers say."""
        if self._header("transfer-encoding") is not None:
            message = "an Upgrade request with a chunked body is not supported; send it without Upgrade"
            self._refusal = (UNMATCHED, bad_http(400, message))
            raise StopParsing
        length = self._header("content-length") or "0"
        if not length.isdigit():
            self._refusal = (UNMATCHED, bad_http(400, f"invalid Content-Length: {length[:40]!r}"))
            raise StopParsing
        # All of it, even past the limit: a body refused (413, 401) is read and dropped like any other, since
        # left unread it would be parsed as the next request and the connection reset under the refusal.
        self._upgrade_body_left = int(length)
        tokens = {t.strip().lower() for t in (self._header("connection") or "").split(",")}
        self._keep_alive = "keep-alive" in tokens if self._version == "1.0" else "close" not in tokens

    def _read_upgrade_body(self, data: bytes) -> None:
        """Read (up to) the rest of an Upgrade request's body from ``data``, then parse on what follows."""
        left = self._upgrade_body_left
        if left:
            piece, data = data[:left], data[left:]
            self._upgrade_body_left -= len(piece)
            try:
                if piece:
                    self.on_body(piece)
            except StopParsing:
                self._upgrade_body_left = 0
                self._stop(None)
                return
            if self._upgrade_body_left:
                return  # more of it to come
            self._reading = IDLE
            self._served = True
            if self._discarding:
                self._stop(None)  # the refused body is all read
                return
            self._complete()
        if data:
            self.data_received(data)

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
                if expects_continue:
                    self._continue()
            elif isinstance(error, GatewayError):
                self._refuse_body(error.with_traceback(None))  # (kept as long as the connection)
            else:
                log.error("identifying a request failed", exc_info=error)  # its handler identifies again
        self._release_reading()
