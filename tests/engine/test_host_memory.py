"""keep_freed_memory: on glibc a multi-MB block comes from the heap and stays there once freed, where by
default it would be a mapping of its own, faulted in again at each use."""

from __future__ import annotations

import ctypes
import sys
import threading

import pytest

from engine.host_memory import keep_freed_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_block_stays_in_the_heap() -> None:
    assert threading.current_thread() is threading.main_thread()  # the main arena grows with sbrk
    if not keep_freed_memory():
        pytest.skip("no glibc mallopt here")
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block = libc.malloc(24 << 20)  # 24 MiB: glibc's default threshold (128 KiB at first) would mmap it
    top = libc.sbrk(0)
    assert block is not None and block < top  # below the program break: the heap, not a mapping
    libc.free(block)
    assert libc.sbrk(0) == top  # kept for the next step, not trimmed
