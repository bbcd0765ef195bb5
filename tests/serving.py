"""Serving an aiohttp app on a free local port: what every in-process engine, publisher and fake needs."""

from __future__ import annotations

from aiohttp import web


async def serve(runner: web.AppRunner) -> str:
    """Set ``runner`` up, listen on a free port of 127.0.0.1, and return the base URL. The caller keeps the
    runner (and its own runner options) and cleans it up."""
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return f"http://127.0.0.1:{runner.addresses[0][1]}"
