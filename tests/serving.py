"""Serving an aiohttp app on a free local port: what every in-process engine, publisher and fake needs; and
whether a port of 127.0.0.1 is free, for the processes the tests start on ports they choose."""

from __future__ import annotations

import socket
import ssl

from aiohttp import web


async def serve(runner: web.AppRunner, *, ssl_context: ssl.SSLContext | None = None) -> str:
    """Set ``runner`` up, listen on a free port of 127.0.0.1, and return the base URL (``https://`` when
    served over TLS with ``ssl_context``). The caller keeps the runner (and its own runner options) and
    cleans it up."""
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context).start()
    scheme = "http" if ssl_context is None else "https"
    return f"{scheme}://127.0.0.1:{runner.addresses[0][1]}"


def bindable(port: int) -> bool:
    """Whether nothing holds ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
