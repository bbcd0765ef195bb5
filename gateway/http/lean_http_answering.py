"""Answering on a lean connection: its queue of requests in arrival order, whole answers and streams
(``LeanStream``) written on the transport, refusals, the hand-off to aiohttp, and shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from gateway.http.errors import GatewayError, InvalidRequest, RequestTimedOut
from gateway.http.http_wire import Answer, head, whole_response
from gateway.http.lean_http_deadlines import LeanDeadlines
from gateway.http.lean_http_state import HEAD, IDLE, LINGER, LeanConnectionState, StopParsing

log = logging.getLogger("kvgate.lean_http")

LINGER_S = 10.0  # how long a refused body is read and dropped, at most


class LeanStream(web.StreamResponse):
    """A streamed answer written on the lean connection, in chunked encoding. Only ``prepare``, ``write``
    and ``write_eof`` are meant to be used, which is all the gateway's relay does."""

    def __init__(self, connection: LeanConnectionState, headers: Mapping[str, str]) -> None:
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


class LeanAnswering(LeanDeadlines):
    """Answers the requests read, one at a time in arrival order, then does what stopped parsing asked
    for: hand the connection to aiohttp, or answer a refusal and close."""

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
            self._reading = LINGER
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
        self._reading = IDLE  # nothing more is read; what is left is answered once the queue is
        if self._refusal is None:
            if self._raw is not None:
                self._handing_off = True  # (aiohttp times the request's body from the hand-off)
            else:
                reason = (
                    "a request pipelined behind another cannot be handed over; send it on its own connection"
                )
                if (
                    exc is not None
                    and not isinstance(exc.__context__, StopParsing)
                    and self._handler is not None
                ):
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

    def _write_whole(self, response: Answer, keep_alive: bool) -> None:
        self.write(whole_response(response, keep_alive))

    def _read_timed_out(self) -> None:
        """The request being read is late: answer 408 once the requests before it are, then close."""
        phase = "header" if self._reading == HEAD else "body"
        self._edge.timed_out(phase)
        self._reading = IDLE
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
