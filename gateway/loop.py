"""uvloop when it is installed, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio


def install_best_loop() -> str:
    """Make new event loops uvloop loops if possible; returns the loop's name."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"
