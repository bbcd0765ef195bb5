"""Running the gateway app: uvloop, handler cancellation (a client that leaves aborts its engine request),
OpenAI-shaped errors even for requests aiohttp cannot parse, graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.app import GATEWAY, build_app, lean_routes
from gateway.billing import spool_path
from gateway.config import KvgateConfig
from gateway.errors import GatewayError
from gateway.lean_http import LeanConnection, LeanHandler
from gateway.loop import install_best_loop, raise_open_file_limit
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
    """aiohttp's server, but each connection starts on ``gateway.lean_http`` when the app has lean routes:
    the completion endpoints are served there, and a connection is handed to aiohttp's own handler (with
    the JSON errors above) at its first request for anything else. Shutdown drains both kinds."""

    gateway: Gateway | None  # None: an app that is not the gateway's (aiohttp serves it all)
    lean: dict[str, LeanHandler]
    lean_connections: set[LeanConnection]

    def __call__(self) -> RequestHandler:
        gateway = self.gateway
        if gateway is None or not self.lean:
            return self.aiohttp_handler()
        connection = LeanConnection(
            self.lean,
            max_body_bytes=gateway.settings.max_body_bytes,
            hand_off=self.aiohttp_handler,
            registry=self.lean_connections,
            answered=gateway.metrics.answered,
        )
        return connection  # type: ignore[return-value]  # any asyncio.Protocol serves

    def aiohttp_handler(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)

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
        server.gateway = self.app.get(GATEWAY)
        server.lean = lean_routes(self.app) if server.gateway is not None else {}
        server.lean_connections = set()
        return server


def runner_for(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """On cleanup the runner stops accepting, lets open requests and streams finish for the gateway's
    ``drain_timeout_s`` (then cancels them: each still gets its usage record), and only then closes the
    app, whose lifespan flushes the ledger."""
    gateway = app.get(GATEWAY)
    drain_s = gateway.resilience.drain_timeout_s if gateway is not None else SHUTDOWN_TIMEOUT_S
    return GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_s, **kwargs)


async def serve_until_signal(
    app: web.Application, host: str, port: int, *, on_ready: Any = None, reuse_port: bool = False
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop accepting, drain, and clean up."""
    runner = runner_for(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=2048, reuse_port=reuse_port or None).start()
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
    asyncio.run(serve_until_signal(build_app(config), s.host, s.port, reuse_port=reuse_port))


def worker_config(config: KvgateConfig, index: int) -> KvgateConfig:
    """Worker ``index``'s configuration: its own gateway id and ledger spool, the same port."""
    update = {"gateway_id": f"{config.gateway_id}-w{index}", "spool_path": f"{spool_path(config)}.w{index}"}
    gateway = config.gateway.model_copy(update=update)
    return dataclasses.replace(config, gateway=gateway)


def run_workers(config: KvgateConfig, workers: int) -> int:
    """``workers`` gateway processes sharing the port (SO_REUSEPORT: the kernel spreads connections).
    Each follows every engine's KV events itself; sessions, the ledger and rate limits are shared only
    through Redis, so without it each worker keeps its own. Stops all when one stops or on SIGINT/SIGTERM."""
    if config.gateway.redis_url is None:
        log.warning(
            "%d workers without Redis: each keeps its own session bindings, usage ledger and rate limits",
            workers,
        )
    context: Any = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    children = [
        context.Process(target=run_gateway, args=(worker_config(config, i),), kwargs={"reuse_port": True},
                        name=f"kvgate-worker-{i}")
        for i in range(workers)
    ]  # fmt: skip
    for child in children:
        child.start()

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        while all(child.is_alive() for child in children):
            multiprocessing.connection.wait([child.sentinel for child in children])
    finally:
        forward(signal.SIGTERM, None)  # one ended: the service is not whole, stop the rest
        for child in children:
            child.join()
    return max(child.exitcode or 0 for child in children)
