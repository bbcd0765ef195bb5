"""Answering on a lean connection: its queue of requests in arrival order, whole answers and streams
(``LeanStream``) written on the transport, refusals, and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from cache.cancelling import cancel_and_wait
from gateway.http.edge import REQUEST_ID
from gateway.http.errors import GatewayError, InvalidRequest, RequestTimedOut
from gateway.http.http_wire import Answer, head, whole_response
from gateway.http.lean_http_deadlines import LeanDeadlines
from gateway.http.lean_http_state import CONTINUE, HEAD, IDLE, LINGER, LeanConnectionState, StopParsing
from gateway.http.lean_routes import Found

if TYPE_CHECKING:
    from gateway.http.lean_request import LeanRequest

log = logging.getLogger("kvgate.lean_http")

LINGER_S = 10.0  # how long a refused body is read and dropped, at most
UNREAD_LINGER_S = 2.0  # after a request that could not be parsed: its sender gets the answer, not a reset


class LeanStream(web.StreamResponse):
    """A streamed answer written on the lean connection, in chunked encoding; or, to an HTTP/1.0 client,
    unframed, the connection's end marking the stream's. Only ``prepare``, ``write`` and ``write_eof`` are
    meant to be used, which is all the gateway's relay does."""

    def __init__(
        self,
        connection: LeanConnectionState,
        headers: Mapping[str, str],
        *,
        chunked: bool = True,
        closes: bool = False,
    ) -> None:
        super().__init__(status=200, headers=headers)
        self._connection = connection
        self.chunked_encoding = chunked
        self._closes = closes or not chunked  # (unframed, only the connection's end ends it)
        self.started = False
        self.finished = False

    async def prepare(self, request: Any) -> None:
        if self.started:
            return
        self.started = True
        framing = [b"Transfer-Encoding: chunked\r\n"] if self.chunked_encoding else []
        if self._closes:  # (RFC 9112 9.6: the last answer on a connection says so)
            framing.append(b"Connection: close\r\n")
        self._connection.write(head(self, *framing))

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self.chunked_encoding:
            await self._connection.write_and_drain(b"%x\r\n%s\r\n" % (len(data), bytes(data)))
        else:
            await self._connection.write_and_drain(bytes(data))

    async def write_eof(self, data: bytes = b"") -> None:
        if self.finished:
            return
        if data:
            await self.write(data)
        self.finished = True
        if self.chunked_encoding:
            await self._connection.write_and_drain(b"0\r\n\r\n")


class LeanAnswering(LeanDeadlines):
    """Answers the requests read, one at a time in arrival order, then does what stopped parsing asked
    for: answer a refusal and close, or (after an Upgrade) just close."""

    async def _answer_queue(self) -> None:
        try:
            while self._queue and self.transport is not None:
                found, request = self._queue.popleft()
                keep_alive = request.keep_alive
                self._queued_bytes -= request.content_length
                response = await self._answer(found, request)
                if isinstance(response, LeanStream):
                    if not response.finished or not response.chunked_encoding:
                        self._close()  # unframed, or it did not end cleanly: the connection's end is its
                        return
                else:
                    keep_alive = keep_alive and not (self._closing and not self._queue)
                    self._write_whole(response, keep_alive, request)
                    if self._drain is not None:  # the client reads none: the next answer waits
                        await self.drained()
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

    async def _answer(self, found: Found, request: LeanRequest) -> Answer:
        """The route's answer; or, for a path or method no route takes, its 404 or 405, counted here (the
        routes' handlers count their own)."""
        if found.handler is not None:
            return await found.handler(request)
        error = found.error or GatewayError("no handler")
        self._answered(found.endpoint, error.status)
        return error.response()

    def _when_idle(self) -> None:
        """The queue is answered: resume reading, and do what stopped parsing asked for."""
        transport = self.transport
        if transport is None:
            return
        self._backlogged = False
        self._release_reading()
        if self._parked:
            self._parse_parked()  # its requests start a new round of answers, which comes back here
            if self._task is not None or self._parked or self._stopped or self.transport is None:
                return
        if self._refusal is not None:
            self._send_refusal()
        elif self._closing or self._stopped:
            self._close()
        else:
            self._idle_since = self._loop.time()
            if self._continue_owed:  # the request being read waits for its 100: its body is due from now
                self._continue_owed = False
                self.write(CONTINUE)
                self._body_began = self._idle_since
            self._arm(self._deadline())

    def _parse_parked(self) -> None:
        """Parse what was read while the queue was full (``LeanConnection`` does)."""
        raise NotImplementedError

    def _refuse_body(self, error: GatewayError) -> None:
        """Refuse the request whose headers are read (body too large, key refused), but read its body on
        (dropping it) before closing: a client still sending when the connection closes gets a reset, not
        the answer."""
        self._refusal = (self._endpoint(), error)
        self._discarding = 1
        self._release_body()
        self._body = []
        if self._task is None:
            self._send_refusal()

    def _send_refusal(self) -> None:
        """Answer the refusal (once) and close, or, while its body is still being dropped, close after that
        or after ``LINGER_S`` at the latest. After a request that could not be parsed, the rest of what the
        client sends is read and dropped for ``UNREAD_LINGER_S`` (its end of the connection is shut at
        once), so that the answer reaches it before the connection closes."""
        if self._refusal is None or self.transport is None:
            return
        if not self._refusal_sent:
            self._refusal_sent = True
            endpoint, error = self._refusal
            self._answered(endpoint, error.status)
            self._write_whole(error.response(), keep_alive=False)
        if self._discarding and not self._stopped:
            self._linger(LINGER_S)
        elif self._unparsed and self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger(UNREAD_LINGER_S)
        else:
            self._close()

    def _linger(self, seconds: float) -> None:
        self._reading = LINGER
        self._linger_until = self._loop.time() + seconds
        self._arm(self._linger_until)

    def _stop(self, exc: BaseException | None) -> None:
        """Parsing ends on this connection: a request refused (as it said, or as malformed), once the
        requests before it are answered."""
        self._stopped = True
        if self._refusal_sent:
            self._close()  # the refused body has been read
            return
        self._reading = IDLE  # nothing more is parsed; what is left is answered once the queue is
        if self._refusal is None:
            reason = (
                "unreadable request" if exc is None or isinstance(exc.__context__, StopParsing) else str(exc)
            )
            error = InvalidRequest(
                f"malformed HTTP request: {reason or type(exc).__name__}", code="bad_http_request"
            )
            self._refusal = (self._endpoint(), error)
        if self._task is None:
            self._when_idle()

    def _write_whole(self, response: Answer, keep_alive: bool, request: LeanRequest | None = None) -> None:
        """Write a whole answer (``request`` None: a refusal of the request being read), named with an
        ``x-request-id`` when its handler gave it none (a completion's names itself, with the id it sent the
        engine: one id per request)."""
        name = self._edge.request_id
        if name is not None and REQUEST_ID not in response.headers:
            raw = request.headers.get(REQUEST_ID) if request is not None else self._header(REQUEST_ID)
            response.headers[REQUEST_ID] = name(raw)
        if request is None or (request.version == "1.1" and request.method != "HEAD"):
            self.write(whole_response(response, keep_alive))
            return
        # An HTTP/1.0 client keeps the connection only when told so; a HEAD gets the head alone.
        data = whole_response(response, keep_alive, announce_keep_alive=request.version == "1.0")
        if request.method == "HEAD":
            head = data if isinstance(data, bytes) else bytes(data[0])  # (parts: the head whole, first)
            data = head[: head.index(b"\r\n\r\n") + 4]
        self.write(data)

    def _read_timed_out(self) -> None:
        """The request being read is late: answer 408 once the requests before it are, then close."""
        phase = "header" if self._reading == HEAD else "body"
        self._edge.timed_out(phase)
        self._reading = IDLE
        if self._refusal is None:
            if phase == "header":
                message = f"the request's headers did not arrive within {self._edge.header_s:g} s"
            else:
                message = (
                    f"the request body arrived too slowly (under {self._edge.body_rate:.0f} bytes/s after "
                    f"its first {self._edge.body_s:g} s)"
                )
            self._refusal = (self._endpoint(), RequestTimedOut(message))
        self._discarding = 0  # (a refusal already due is answered, and then the connection closes)
        self._stop(None)

    # -- shutdown --------------------------------------------------------------------------------------

    def close_when_idle(self) -> None:
        """Stop taking requests: close now if idle, else once the requests read so far are answered."""
        self._closing = True
        if self._task is None:
            self._close()

    @property
    def answering(self) -> bool:
        """Whether a request of this connection is being answered (or waits its turn)."""
        return self._task is not None

    def end_now(self) -> None:
        """Stop taking requests, and cancel the one in progress now: the drain is cut short (a second
        signal). Its handler stops its engine request and accounts for it, as at the end of a drain."""
        self.close_when_idle()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    async def shutdown(self, grace_s: float | None) -> None:
        """Let the request in progress finish for ``grace_s`` seconds, then cancel it; close."""
        self.close_when_idle()
        task = self._task
        if task is not None:
            done, _ = await asyncio.wait({task}, timeout=grace_s)
            if not done:
                with contextlib.suppress(Exception):  # (its errors are answered and logged where it runs)
                    await cancel_and_wait(task)
        self._close()
