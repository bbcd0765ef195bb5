"""Running the gateway app: uvloop, handler cancellation (a client that leaves aborts its engine request),
OpenAI-shaped errors even for requests aiohttp cannot parse, graceful shutdown on SIGINT/SIGTERM, and the
edge of the public port (``[gateway.edge]``): connection caps and read deadlines on every connection,
whether ``gateway.http.lean_http`` or aiohttp serves it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.app import GATEWAY, build_app, lean_routes
from gateway.config import KvgateConfig
from gateway.http.edge import ConnectionLimits, Edge
from gateway.http.errors import GatewayError, RequestTimedOut
from gateway.http.http_wire import whole_response
from gateway.http.lean_http import LeanConnection, LeanHandler
from gateway.http.listening import PORT_FLAG, check_can_listen, listen_error, log_listening
from gateway.http.loop import install_best_loop, raise_open_file_limit, settle_gc
from gateway.service import Gateway

log = logging.getLogger("kvgate.server")

SHUTDOWN_TIMEOUT_S = 10.0
MAX_FIELD_BYTES = 8190  # aiohttp's limit on a request line or a header line


class _JsonErrorRequestHandler(RequestHandler):
    """Requests that fail below the application (a bad request line, a header with control characters)
    get the same OpenAI-shaped JSON error as everything else, instead of aiohttp's plain text."""

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0 or status >= 500:
            return super().handle_error(request, status, exc, message)
        self.logger.debug("bad HTTP request from %s: %s", request.remote, exc)
        detail = getattr(exc, "message", None) or message or HTTPStatus(status).phrase
        error = GatewayError(f"malformed HTTP request: {str(detail).strip()}")
        if isinstance(exc, LineTooLong) or "Too many headers" in str(detail):
            # Said without echoing the header back: it may be a credential.
            status = 431
            error = GatewayError(f"request headers too large (at most {MAX_FIELD_BYTES} bytes a line)")
        error.status, error.type, error.code = status, "invalid_request_error", "bad_http_request"
        response = error.response()
        response.force_close()
        return response


_IDLE, _HEAD, _BODY = 0, 1, 2  # what an _EdgeRequestHandler is reading


class _EdgeRequestHandler(_JsonErrorRequestHandler):
    """aiohttp's handler on the gateway's public port: the connection caps (unless ``gateway.http.lean_http``
    admitted the connection before handing it over) and the ``[gateway.edge]`` read deadlines for the
    requests aiohttp reads itself: every request with ``lean_http = false``, and on a handed-over keep-alive
    connection every request after the first.

    A request's clock starts at the first byte read while none is in progress. aiohttp counts a request
    (``_request_count``) once its head is parsed: until then the header deadline holds; then, while its body
    (``payload``) has not all arrived, the body deadline (``Edge.body_deadline``). A late head gets a 408
    written here if nothing is being answered (else the answer in progress ends the connection); a late body
    fails the handler's read of it with RequestTimedOut, a 408 through the app's own error handling. Nothing
    more is read on the connection either way. The idle keep-alive timeout is aiohttp's own
    (``keepalive_timeout``, set to ``idle_timeout_s``)."""

    def __init__(self, manager: web.Server, *, edge: Edge, client: str | None, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._edge = edge
        self._client = client  # the connection's slot in edge.limits (None: not admitted yet)
        self._refused = False
        self._reading = _IDLE
        self._head_count = 0  # _request_count when the request being read began
        self._began = 0.0
        self._payload: StreamReader | None = None
        self._body_bytes = 0
        self._timed_out = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        fresh = self._client is None  # (a handed-over connection has sent a request already)
        if fresh:
            self._client = self._edge.limits.admit(transport, transport.get_extra_info("peername"))
            if self._client is None:
                self._refused = True  # answered 503 and closing: aiohttp never starts on it
                return
        super().connection_made(transport)
        if fresh:  # its first request is owed within the header deadline of the accept, as on lean_http's
            self._loop.call_at(self._loop.time() + self._edge.header_s, self._first_request_due)

    def _first_request_due(self) -> None:
        if self.transport is not None and self._reading == _IDLE and self._request_count == 0:
            self.force_close()  # it sent nothing: no request to answer

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._client is not None:
            self._edge.limits.release(self._client)
            self._client = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused or self._timed_out:
            return  # a request timed out: the rest of it, and anything after, is not read
        if self._reading == _IDLE and data:
            self._begin(_HEAD)
        elif self._reading == _BODY:
            self._body_bytes += len(data)
        super().data_received(data)
        if self._request_count != self._head_count:  # heads were parsed: the last one's body is read now
            self._head_count = self._request_count
            payload = self._messages[-1][1] if self._messages else None
            if payload is not None and not payload.is_eof():
                self._payload = payload
                self._begin(_BODY)
            else:
                self._reading, self._payload = _IDLE, None
        elif self._reading == _BODY and self._payload is not None and self._payload.is_eof():
            self._reading, self._payload = _IDLE, None

    def _begin(self, reading: int) -> None:
        self._reading = reading
        self._began = self._loop.time()
        self._head_count = self._request_count
        self._body_bytes = 0
        self._arm()

    def _deadline(self) -> float:
        edge = self._edge
        if self._reading == _HEAD:
            return self._began + edge.header_s
        return edge.body_deadline(self._began, self._body_bytes)

    def _arm(self) -> None:
        if self._timer is None:  # (one already due re-arms itself for the deadline in force then)
            self._timer = self._loop.call_at(self._deadline(), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self.transport is None or self._timed_out or self._reading == _IDLE:
            return
        if self._reading == _HEAD and self._request_count != self._head_count:
            self._reading = _IDLE  # parsed outside data_received (after a declined upgrade): not timed
            return
        if self._reading == _BODY and (self._payload is None or self._payload.is_eof()):
            self._reading, self._payload = _IDLE, None
            return
        now = self._loop.time()
        if self._reading_paused:
            # aiohttp holds reading (its buffers are full): the wait is the server's, the clock restarts.
            self._began, self._body_bytes = now, 0
        if now < self._deadline():
            self._arm()
            return
        self._timed_out = True
        if self._reading == _HEAD:
            self._head_timed_out()
        else:
            self._body_timed_out()

    def _head_timed_out(self) -> None:
        edge = self._edge
        edge.timed_out("header")
        waiter = self._waiter
        if waiter is not None and not waiter.done() and not self._messages and self.transport is not None:
            # Idle: nothing else is being answered, the 408 may go out at once.
            error = RequestTimedOut(f"the request's headers did not arrive within {edge.header_s:g} s")
            self.transport.write(whole_response(error.response(), keep_alive=False))
            self.force_close()  # (the transport closes once the 408 is written)
        else:
            self.close()  # the answer in progress goes out, then the connection closes

    def _body_timed_out(self) -> None:
        edge = self._edge
        edge.timed_out("body")
        payload = self._payload
        self._reading, self._payload = _IDLE, None
        request = self._current_request
        answering = request is not None and request.content is payload
        if payload is None or not (answering or any(p is payload for _, p in self._messages)):
            self.force_close()  # its answer is written already (aiohttp was reading the rest to drop it)
            return
        message = (
            f"the request body arrived too slowly (under {edge.body_rate:.0f} bytes/s after its first "
            f"{edge.body_s:g} s)"
        )
        # The handler's read of the body raises it (a 408 through the app's middleware); eof: aiohttp does
        # not linger on a body that will never be read.
        payload.set_exception(RequestTimedOut(message))
        payload.feed_eof()
        self.close()


class GatewayServer(web.Server):
    """aiohttp's server, but each connection starts on ``gateway.http.lean_http`` when the app has lean
    routes: the completion endpoints are served there, and a connection is handed to aiohttp's own handler
    (with the JSON errors above) at its first request for anything else. Shutdown drains both kinds. For the
    gateway's app every connection is under ``edge`` (caps, read deadlines); other apps (engines served
    by the same runner) get aiohttp's handler as it is."""

    gateway: Gateway | None  # None: an app that is not the gateway's (aiohttp serves it all)
    lean: dict[str, LeanHandler]
    lean_connections: set[LeanConnection]
    edge: Edge | None

    def __call__(self) -> RequestHandler:
        gateway, edge = self.gateway, self.edge
        if gateway is None or edge is None:
            return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        if not self.lean:
            return self.aiohttp_handler(None)
        connection = LeanConnection(
            self.lean,
            max_body_bytes=gateway.settings.max_body_bytes,
            hand_off=self.aiohttp_handler,
            registry=self.lean_connections,
            answered=gateway.metrics.answered,
            edge=edge,
        )
        return connection  # type: ignore[return-value]  # any asyncio.Protocol serves

    def aiohttp_handler(self, client: str | None) -> RequestHandler:
        """aiohttp's handler for a connection of the public port; ``client``: its slot in the caps, when
        ``gateway.http.lean_http`` admitted it already (None: admitted on connection_made)."""
        assert self.edge is not None
        kwargs = {"keepalive_timeout": self.edge.idle_s, **self._kwargs}
        return _EdgeRequestHandler(self, loop=self._loop, edge=self.edge, client=client, **kwargs)

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for connection in list(self.lean_connections):
            connection.close_when_idle()

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (aiohttp's signature)
        lean = [connection.shutdown(timeout) for connection in list(self.lean_connections)]
        await asyncio.gather(super().shutdown(timeout), *lean)


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GatewayServer
        assert isinstance(server, GatewayServer)
        server.gateway = gateway = self.app.get(GATEWAY)
        server.lean = lean_routes(self.app) if gateway is not None else {}
        server.lean_connections = set()
        server.edge = edge_for(gateway) if gateway is not None else None
        return server


def edge_for(gateway: Gateway) -> Edge:
    """The public port's ``[gateway.edge]``: caps, deadlines, the key check before a body, their metrics."""
    settings, metrics = gateway.settings.edge, gateway.metrics
    limits = ConnectionLimits(
        max_total=connection_cap(settings.max_connections),
        max_per_client=settings.max_connections_per_client,
        exempt=settings.per_client_exempt,
        refused=lambda reason: metrics.connections_refused.labels(reason).inc(),
    )
    metrics.open_connections = lambda: limits.open
    return Edge(
        settings,
        limits,
        identify=gateway.billing.identify if gateway.settings.auth.enabled else None,
        timed_out=lambda phase: metrics.read_timeouts.labels(phase).inc(),
    )


def connection_cap(configured: int) -> int:
    """``max_connections``, but never more than 40% of the open-file soft limit: a client connection may
    hold an engine connection too, and two per client must fit in 80% of the limit, the rest being room for
    idle engine connections, Redis, logs and the listening socket. Past the limit accept() fails and every
    request, /health too, is reset; past the cap a client gets a 503 that says so."""
    try:
        import resource
    except ImportError:  # not on this platform
        return configured
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return configured
    cap = max(1, soft * 2 // 5)
    if cap < configured:
        log.info("gateway.edge.max_connections: %d (40%% of the open-file limit of %d)", cap, soft)
    return min(configured, cap)


def runner_for(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """On cleanup the runner stops accepting, lets open requests and streams finish for the gateway's
    ``drain_timeout_s`` (then cancels them: each still gets its usage record), and only then closes the
    app, whose lifespan flushes the ledger."""
    gateway = app.get(GATEWAY)
    drain_s = gateway.resilience.drain_timeout_s if gateway is not None else SHUTDOWN_TIMEOUT_S
    return GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_s, **kwargs)


async def serve_until_signal(
    app: web.Application,
    host: str,
    port: int,
    *,
    on_ready: Any = None,
    reuse_port: bool = False,
    port_flag: str = PORT_FLAG,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop accepting, drain, and clean up."""
    runner = runner_for(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            raise listen_error(host, port, exc, port_flag=port_flag) from exc
        log_listening(app, runner)
        if on_ready is not None:
            on_ready()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()


def run_gateway(config: KvgateConfig, *, reuse_port: bool = False) -> None:
    install_best_loop()
    raise_open_file_limit()
    s = config.gateway
    if not reuse_port:  # (a worker shares the port with its siblings: run_workers checked it first)
        check_can_listen(s.host, s.port)
    app = build_app(config)
    asyncio.run(serve_until_signal(app, s.host, s.port, reuse_port=reuse_port, on_ready=settle_gc))
