"""Processes that must not outlive their parent: Linux's PR_SET_PDEATHSIG, shared by the gateway (its
workers, their private redis-server, the demo's engines) and the engine (its core process). It lives in
``cache`` because both packages import it and neither may import the other."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel send this process SIGTERM when its parent dies, however it dies (SIGKILL too);
    nothing off Linux. Safe as a ``preexec_fn``. A multiprocessing child whose parent was already gone
    before the call (it then has another parent) sends itself the SIGTERM it missed."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)
