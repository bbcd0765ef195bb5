"""Running the gateway app: uvloop, handler cancellation (a client that leaves aborts its engine request),
OpenAI-shaped errors even for requests aiohttp cannot parse, graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from gateway.app import GATEWAY, build_app
from gateway.config import KvgateConfig
from gateway.errors import GatewayError
from gateway.loop import install_best_loop, raise_open_file_limit

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


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer
        return server


def runner_for(app: web.Application, **kwargs: Any) -> web.AppRunner:
    """On cleanup the runner stops accepting, lets open requests and streams finish for the gateway's
    ``drain_timeout_s`` (then cancels them: each still gets its usage record), and only then closes the
    app, whose lifespan flushes the ledger."""
    gateway = app.get(GATEWAY)
    drain_s = gateway.resilience.drain_timeout_s if gateway is not None else SHUTDOWN_TIMEOUT_S
    return GatewayRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=drain_s, **kwargs)


async def serve_until_signal(app: web.Application, host: str, port: int, *, on_ready: Any = None) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop accepting, drain, and clean up."""
    runner = runner_for(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=2048).start()
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


def run_gateway(config: KvgateConfig) -> None:
    install_best_loop()
    raise_open_file_limit()
    s = config.gateway
    asyncio.run(serve_until_signal(build_app(config), s.host, s.port))
