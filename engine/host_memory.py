"""glibc's malloc kept from handing big tensors' memory back to the kernel between steps (a CPU engine).

By default glibc serves an allocation of a few MB with a fresh mmap and unmaps it when freed, or trims the
heap once its free top passes a threshold, so every step of a CPU engine page-faults its activations in
again: ~18,000 minor faults and ~30 ms of a 2000-token prefill on this project's 2-core test machine (vLLM's
CPU build preloads tcmalloc for the same reason). Raising both thresholds keeps the freed memory for the next
step; the heap then stays at its peak.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameters, glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): larger ones still mmap
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above; False where there is no glibc (or it refused)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
