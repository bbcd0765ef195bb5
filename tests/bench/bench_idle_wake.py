"""What an idle gap before a request costs its CPU work on this machine: the gateway's work before dispatch
(bench_request_path's chat request: read, validate, render, tokenize, hash, route) timed once per call, each
call after the process slept ``gap`` (as the gateway sleeps in epoll between requests at concurrency 1),
against the same work back to back; beside it a fixed piece of plain Python (no kvgate code) timed the same
way, which tells a property of the machine from one of kvgate.

    python tests/bench/bench_idle_wake.py [--calls 2000] [--gaps 0,0.2,1,5]

Why it exists: at concurrency 1 (bench_routers' added p50) the gateway's pre-dispatch time, read from its
``kvgate_routing_overhead_seconds``, is several times bench_request_path's tight-loop figure, in CPU time
(``time.thread_time``), not in waiting. On a virtual machine whose vCPU halts when idle, code that runs
right after a sleep finds cold caches (and a host that may have run others on that core): every router
pays that in proportion to the instructions and memory it touches per request, so it widens the c=1 gaps
between routers beyond their c=32 CPU figures. On a busy bare-metal gateway the gap between requests is
short and the penalty small; the c=32 CPU per request is the figure that carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_request_path import gateway_for, lean_request
from bench_routers import byte_tokenizer_dir, chat_body

from gateway.http.loop import install_best_loop
from gateway.service import Gateway


def plain_python() -> int:
    """A fixed piece of work of about the same size, in no library: dicts, strings and ints."""
    counts: dict[str, int] = {}
    for i in range(400):
        key = f"k{i % 37}"
        counts[key] = counts.get(key, 0) + i
    return sum(counts.values())


async def before_dispatch(gateway: Gateway, i: int) -> None:
    """The overhead bench's chat request number ``i`` prepared and routed, its route given back."""
    raw = chat_body(i)
    request = lean_request(raw, "/v1/chat/completions")
    p = await gateway.prepare.chat(request, orjson.loads(raw))
    route = gateway.router.decide(gateway.router.plan(p))
    assert not isinstance(route, Exception)
    gateway.router.release(route)


async def median_us(work: Callable[[int], object], gap_s: float, calls: int) -> float:
    """Median microseconds of one call of ``work`` made ``gap_s`` after the previous one ended."""
    times = []
    for i in range(calls):
        if gap_s:
            time.sleep(gap_s)  # noqa: ASYNC251  (the whole process sleeps, as an idle loop does in epoll)
        start = time.perf_counter()
        result = work(i % 50)
        if asyncio.iscoroutine(result):
            await result
        times.append(time.perf_counter() - start)
    return statistics.median(times[calls // 10 :]) * 1e6


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        gateway = gateway_for(byte_tokenizer_dir(Path(tmp) / "tokenizer"))
        works: dict[str, Callable[[int], object]] = {
            "kvgate before dispatch": lambda i: before_dispatch(gateway, i),
            "plain Python": lambda i: plain_python(),
        }
        gaps = [float(g) / 1e3 for g in args.gaps.split(",")]
        for work in works.values():
            await median_us(work, 0.0, 200)  # (warm-up: imports, caches, the tokenizer's chunk cache)
        # Gaps interleaved over repeats, so that a drift of the machine falls on all alike.
        figures: dict[str, dict[float, list[float]]] = {n: {g: [] for g in gaps} for n in works}
        for _ in range(args.repeats):
            for gap in gaps:
                for name, work in works.items():
                    figures[name][gap].append(await median_us(work, gap, args.calls))
        print(f"median us per call, after an idle gap (median of {args.repeats} repeats; x: against no gap)")
        print(f"{'work':24s}" + "".join(f"{f'gap {g * 1e3:g} ms':>20s}" for g in gaps))
        for name, by_gap in figures.items():
            base = statistics.median(by_gap[gaps[0]])
            cells = []
            for gap in gaps:
                us = statistics.median(by_gap[gap])
                cells.append(f"{us:9.1f} us {us / base:5.1f}x")
            print(f"{name:24s}" + "".join(f"{c:>20s}" for c in cells))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=1000, help="calls per gap and repeat")
    parser.add_argument("--gaps", default="0,0.2,1,5", help="idle gaps in milliseconds, the first the base")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    install_best_loop()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
