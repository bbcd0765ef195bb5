"""The gateway's garbage-collector settings once it serves (``gateway.http.loop.settle_gc``): start-up's
objects frozen out of later collections, the young generation collected less often, cycles still found."""

from __future__ import annotations

import subprocess
import sys

from gateway.http.loop import GC_YOUNG_THRESHOLD

SCRIPT = """
import gc, weakref
from gateway.http.loop import GC_YOUNG_THRESHOLD, settle_gc
before = gc.get_threshold()
settle_gc()
assert gc.get_freeze_count() > 1000, gc.get_freeze_count()  # the imported modules' objects at least
assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:]), gc.get_threshold()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a  # a cycle made after start-up is still collected
alive = weakref.ref(a)
del a, b
gc.collect()
assert alive() is None
print("ok")
"""


def test_settle_gc_freezes_start_up_and_raises_only_the_young_threshold() -> None:
    assert GC_YOUNG_THRESHOLD > 700  # CPython's default, which collected every few requests
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
