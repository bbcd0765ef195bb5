"""Running the simulated engine as a process: serve its application until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import socket
import ssl

from aiohttp import web

from engine.process_serving import event_loop_factory, serve_until_stopped
from engine.sim.server import SimEngineConfig, build_app

_SHUTDOWN_TIMEOUT_S = 2.0  # a simulator need not let long streams finish before it stops


def serve(
    config: SimEngineConfig, *, sock: socket.socket | None = None, ssl_context: ssl.SSLContext | None = None
) -> int:
    """Run the simulator until SIGINT or SIGTERM (on uvloop when installed); returns the exit status.

    ``sock``: an already bound socket to serve on instead of ``config.host``/``config.port``;
    ``ssl_context``: serve https:// with it.
    """
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve(config, sock, ssl_context))


async def _serve(
    config: SimEngineConfig, sock: socket.socket | None, ssl_context: ssl.SSLContext | None
) -> int:
    app = build_app(config)

    def site_for(runner: web.AppRunner) -> web.BaseSite:
        if sock is not None:
            return web.SockSite(runner, sock, backlog=2048, ssl_context=ssl_context)
        return web.TCPSite(runner, config.host, config.port, backlog=2048, ssl_context=ssl_context)

    def serving_line(url: str) -> str:
        return f"kvgate sim-engine {config.engine_id}: SIMULATED engine serving {config.model!r} on {url}"

    return await serve_until_stopped(
        app, site_for, serving_line, tls=ssl_context is not None, shutdown_timeout_s=_SHUTDOWN_TIMEOUT_S
    )
