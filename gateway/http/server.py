"""Running the gateway app: uvloop, every connection of the public port served by ``gateway.http.lean_http``
under the edge (``[gateway.edge]``: connection caps and read deadlines), a client that leaves aborting its
engine request, graceful shutdown on SIGINT/SIGTERM. Other apps run by the same runner (the engines) are
aiohttp's, with OpenAI-shaped errors even for requests aiohttp cannot parse."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.app import GATEWAY, build_app, public_routes
from gateway.config import KvgateConfig
from gateway.http.edge import ConnectionLimits, Edge
from gateway.http.errors import GatewayError
from gateway.http.lean_http import LeanConnection
from gateway.http.lean_routes import Routes
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


class GatewayServer(web.Server):
    """aiohttp's server (its runner, sites and shutdown), but for the gateway's app every connection is
    served by ``gateway.http.lean_http`` under ``edge`` (caps, read deadlines); shutdown drains them. Other
    apps (engines served by the same runner) get aiohttp's handler, with the JSON errors above."""

    gateway: Gateway | None  # None: an app that is not the gateway's (aiohttp serves it all)
    routes: Routes
    lean_connections: set[LeanConnection]
    edge: Edge | None

    def __call__(self) -> RequestHandler:
        gateway, edge = self.gateway, self.edge
        if gateway is None or edge is None:
            return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        connection = LeanConnection(
            self.routes,
            max_body_bytes=gateway.settings.max_body_bytes,
            registry=self.lean_connections,
            answered=gateway.metrics.answered,
            edge=edge,
        )
        return connection  # type: ignore[return-value]  # any asyncio.Protocol serves

    def pre_shutdown(self) -> None:
        super().pre_shutdown()
        for connection in list(self.lean_connections):
            connection.close_when_idle()

    async def shutdown(self, timeout: float | None = None) -> None:  # noqa: ASYNC109 (aiohttp's signature)
        lean = [connection.shutdown(timeout) for connection in list(self.lean_connections)]
        await asyncio.gather(super().shutdown(timeout), *lean)

    def answering(self) -> int:
        """How many connections have a request being answered."""
        return sum(connection.answering for connection in self.lean_connections)

    def end_now(self) -> None:
        """Cut the drain short: every request still being answered is cancelled now (each still gets its
        usage record, for what its engine did); the rest of the stop (the ledger's last write) goes on."""
        for connection in list(self.lean_connections):
            connection.end_now()


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = GatewayServer
        assert isinstance(server, GatewayServer)
        server.gateway = gateway = self.app.get(GATEWAY)
        server.routes = public_routes(self.app) if gateway is not None else Routes(())
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
        request_id=gateway.prepare.new_request_id,
    )
    metrics.open_connections = lambda: limits.open
    return Edge(
        settings,
        limits,
        identify=gateway.billing.identify if gateway.settings.auth.enabled else None,
        timed_out=lambda phase: (
            metrics.write_timeouts.labels() if phase == "write" else metrics.read_timeouts.labels(phase)
        ).inc(),
        request_id=gateway.prepare.new_request_id,  # (the completions' own ids come from it too)
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
    return GatewayRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_drain_s(app), **kwargs
    )


def _drain_s(app: web.Application) -> float:
    gateway = app.get(GATEWAY)
    return gateway.resilience.drain_timeout_s if gateway is not None else SHUTDOWN_TIMEOUT_S


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
    late: asyncio.TimerHandle | None = None
    try:
        # (Before the port opens: a signal that came once it was open but before this, a Ctrl-C as it
        # started, was a KeyboardInterrupt's traceback.)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        site = web.TCPSite(runner, host, port, backlog=2048, reuse_port=reuse_port or None)
        try:
            await site.start()
        except OSError as exc:
            raise listen_error(host, port, exc, port_flag=port_flag) from exc
        log_listening(app, runner)
        if on_ready is not None:
            on_ready()
        await stop.wait()
        drain_s = _drain_s(app)
        server = runner.server
        if isinstance(server, GatewayServer) and server.gateway is not None:
            _second_signal_ends_the_drain(loop, server, drain_s)
        late = loop.call_later(drain_s + STILL_STOPPING_AFTER_S, _say_what_stopping_waits_on, drain_s)
    finally:
        await runner.cleanup()
        if late is not None:  # (stopped in time; the loop may run on: `kvgate demo` stops its engines)
            late.cancel()


def _second_signal_ends_the_drain(
    loop: asyncio.AbstractEventLoop, server: GatewayServer, drain_s: float
) -> None:
    """The stop has begun: say so, and let a second SIGINT (a second Ctrl-C) end the drain at once, as
    uvicorn's does, instead of the operator waiting out ``drain_timeout_s`` or killing the gateway (which
    leaves the ledger's last write to the next start's replay). A second SIGTERM does not: a supervisor
    may send one to every process of its service and ``kvgate serve`` forwards its own to its workers, so
    a worker gets two for one stop."""
    answering = server.answering()
    log.info(
        "stopping: no new connections; the requests being answered (%d) may finish within %g s "
        "(a second Ctrl-C ends them now)",
        answering,
        drain_s,
    )
    ended = False

    def end_now() -> None:
        nonlocal ended
        if ended:
            return
        ended = True
        log.warning(
            "stopping now: ending the requests still being answered (%d; each is billed for what its "
            "engine did); the usage ledger's last write still runs",
            server.answering(),
        )
        server.end_now()

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGINT, end_now)


ASYNCIO_DIR = os.path.dirname(asyncio.__file__)
STILL_STOPPING_AFTER_S = 5.0  # past the drain, when the rest of a stop (ledger, Redis, followers) is late


def _innermost_line(awaitable: object) -> str:
    """The file and line where a suspended coroutine chain waits: its innermost coroutine outside asyncio
    itself (an Event's or a Queue's own line says nothing of who waits)."""
    at = "?"
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        if frame is not None and not frame.f_code.co_filename.startswith(ASYNCIO_DIR):
            at = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    return at


def _say_what_stopping_waits_on(drain_s: float) -> None:
    """A stop late past its drain says what it still waits on: each task and the line it waits at (the
    tasks of a stop that hung in CI could only be guessed at)."""
    current = asyncio.current_task()
    waiting = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    where = [f"{task.get_name()} at {_innermost_line(task.get_coro())}" for task in waiting]
    log.warning(
        "still stopping %.0f s after the drain of %.0f s began, waiting on %d tasks: %s",
        STILL_STOPPING_AFTER_S,
        drain_s,
        len(where),
        "; ".join(sorted(where)) or "none",
    )


def run_gateway(config: KvgateConfig, *, reuse_port: bool = False) -> None:
    install_best_loop()
    raise_open_file_limit()
    s = config.gateway
    if not reuse_port:  # (a worker shares the port with its siblings: run_workers checked it first)
        check_can_listen(s.host, s.port)
    app = build_app(config)
    asyncio.run(serve_until_signal(app, s.host, s.port, reuse_port=reuse_port, on_ready=settle_gc))
