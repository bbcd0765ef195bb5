"""An engine's aiohttp app served as a process (kvgate's engine and the simulated one): on uvloop when
installed, until SIGINT or SIGTERM, with one line on stderr that says where it serves. Torch-free, as the
simulated engine must be."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable
from typing import Any

from aiohttp import web


def event_loop_factory() -> Any:
    """uvloop's loop factory, or None (asyncio's own loop) where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:  # uvloop is optional (and absent on Windows)
        return None
    return uvloop.new_event_loop


async def serve_until_stopped(
    app: web.Application,
    site_for: Callable[[web.AppRunner], web.BaseSite],
    serving_line: Callable[[str], str],
    *,
    tls: bool,
    shutdown_timeout_s: float,
) -> int:
    """Serve ``app`` on ``site_for(runner)`` until SIGINT or SIGTERM; returns the exit status. Once the
    signals are handled, ``serving_line(url)`` goes to stderr: whoever started the process may read the URL
    from it (an IPv6 host in brackets) and stop it from then on."""
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    try:
        await site_for(runner).start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # before the line that says it serves
            with contextlib.suppress(NotImplementedError):  # no signal handlers on Windows loops
                loop.add_signal_handler(sig, stop.set)
        host, port = runner.addresses[0][:2]
        url_host = f"[{host}]" if ":" in host else host
        print(serving_line(f"{'https' if tls else 'http'}://{url_host}:{port}"), file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
