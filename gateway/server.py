"""Running the gateway app: uvloop, handler cancellation (a client that leaves aborts its engine request),
graceful shutdown on SIGINT/SIGTERM."""

from __future__ import annotations

from aiohttp import web

from gateway.app import build_app
from gateway.config import KvgateConfig
from gateway.loop import install_best_loop

SHUTDOWN_TIMEOUT_S = 10.0


def runner_for(app: web.Application) -> web.AppRunner:
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)


def run_gateway(config: KvgateConfig) -> None:
    install_best_loop()
    s = config.gateway
    web.run_app(
        build_app(config),
        host=s.host,
        port=s.port,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        print=lambda msg: None,
    )
