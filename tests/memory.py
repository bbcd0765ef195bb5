"""What a step keeps in memory when it is repeated: the check behind "bounded, whatever clients send"."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable

WARM_UP = 5_000  # past any bounded cache's size: what stays after these is what grows
MEASURED = 20_000


def bytes_kept(step: Callable[[int], object], *, warm_up: int = WARM_UP, measured: int = MEASURED) -> int:
    """Bytes still allocated after ``measured`` more calls of ``step(i)`` than after ``warm_up`` of them."""
    tracemalloc.start()  # (before the warm-up: what it allocated and is freed later counts as freed)
    try:
        for i in range(warm_up):
            step(i)
        before = tracemalloc.get_traced_memory()[0]
        for i in range(warm_up, warm_up + measured):
            step(i)
        return int(tracemalloc.get_traced_memory()[0] - before)
    finally:
        tracemalloc.stop()
