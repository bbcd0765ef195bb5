"""Running the simulated engine as a process: serve its application until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import ssl
import sys
from typing import Any

from aiohttp import web

from engine.sim.server import SimEngineConfig, build_app

_SHUTDOWN_TIMEOUT_S = 2.0  # a simulator need not let long streams finish before it stops


def _new_event_loop_factory() -> Any:
    try:
        import uvloop
    except ImportError:  # uvloop is optional (and absent on Windows)
        return None
    return uvloop.new_event_loop


def serve(
    config: SimEngineConfig, *, sock: socket.socket | None = None, ssl_context: ssl.SSLContext | None = None
) -> int:
    """Run the simulator until SIGINT or SIGTERM (on uvloop when installed); returns the exit status.

    ``sock``: an already bound socket to serve on instead of ``config.host``/``config.port``;
    ``ssl_context``: serve https:// with it.
    """
    with asyncio.Runner(loop_factory=_new_event_loop_factory()) as runner:
        return runner.run(_serve(config, sock, ssl_context))


async def _serve(
    config: SimEngineConfig, sock: socket.socket | None, ssl_context: ssl.SSLContext | None
) -> int:
    app = build_app(config)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=_SHUTDOWN_TIMEOUT_S
    )
    await runner.setup()
    try:
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock, backlog=2048, ssl_context=ssl_context)
        else:
            site = web.TCPSite(runner, config.host, config.port, backlog=2048, ssl_context=ssl_context)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows loops
                loop.add_signal_handler(sig, stop.set)
        host, port = runner.addresses[0][:2]
        url_host = f"[{host}]" if ":" in host else host
        print(
            f"kvgate sim-engine {config.engine_id}: SIMULATED engine serving {config.model!r} "
            f"on {'http' if ssl_context is None else 'https'}://{url_host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
