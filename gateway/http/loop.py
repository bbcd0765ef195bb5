"""uvloop when it is installed, asyncio's own loop otherwise."""

from __future__ import annotations

import asyncio
import contextlib


def install_best_loop() -> str:
    """Make new event loops uvloop loops if possible; returns the loop's name."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def raise_open_file_limit() -> int:
    """Lift the soft limit on open files to the hard one: every client and every engine connection is a
    file, and the common default of 1,024 would cap a gateway at a few hundred concurrent streams."""
    try:
        import resource
    except ImportError:  # not on this platform
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
