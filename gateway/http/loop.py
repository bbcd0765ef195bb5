"""How a server process runs: uvloop when it is installed (asyncio's own loop otherwise), its open-file
limit raised, and the garbage collector settled once it serves."""

from __future__ import annotations

import asyncio
import contextlib
import gc

# Container allocations (net of frees) between two young-generation collections; CPython's default is 700.
# A request allocates a few hundred containers and frees nearly all of them itself (its cycles are rare), so
# at the default the collector ran every few requests, walking objects that were about to die anyway.
GC_YOUNG_THRESHOLD = 20_000


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


def settle_gc() -> None:
    """For a long-running server, once it is ready: collect what start-up left, move everything alive
    (modules, configuration, the app and its tables) to the permanent generation so no later collection
    walks it again (``gc.freeze``), and collect the young generation less often (``GC_YOUNG_THRESHOLD``).
    Cycles are still collected; the older generations keep their thresholds."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
