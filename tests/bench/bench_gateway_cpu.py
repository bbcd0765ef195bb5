"""The gateway's CPU per request at concurrency 32, this checkout against another, in interleaved pairs.

    python tests/bench/bench_gateway_cpu.py --baseline-checkout DIR [--pairs 5] [--duration 4]

DIR is another kvgate source tree (``git worktree add DIR COMMIT``; or a copy with modules compiled by
mypyc, whose extension modules Python imports before the .py files beside them). Four zero-cost simulated
engines (bench_gateway_overhead's) are started once; then, ``--pairs`` times, a gateway from each tree in
turn (the order alternating) serves ``--duration`` seconds of requests at concurrency 32 after a warm-up,
and its user + system CPU over the requests it answered is its figure. This 2-core machine's speed drifts
by a fifth from one minute to the next, so only the ratio within each pair is read: the table prints each
pair and the median ratio (below 1: this checkout spends less).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import (
    body,
    cpu_seconds,
    one,
    start_engines,
    start_gateway,
    throughput_round,
    tree_launch,
)

from gateway.demo import EngineProcess, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop
from gateway.http.upstream import UpstreamPool

HERE = Path(__file__).resolve().parents[2]


async def cpu_per_request(
    tree: Path, engines: list[EngineProcess], workdir: Path, duration: float, concurrency: int
) -> float:
    """Milliseconds of the gateway's CPU per request, a gateway from ``tree`` in front of ``engines``."""
    gateway, port = start_gateway(engines, None, workdir, **tree_launch(tree))
    pool = UpstreamPool("127.0.0.1", port)
    try:
        await wait_healthy([EngineProcess("bench", "gateway", port, gateway)])
        for i in range(300):  # warm-up: connections, caches, the gateway's view
            await one(pool, body(i))
        before = cpu_seconds(gateway.pid)
        rate = await throughput_round(pool, concurrency, duration)
        return (cpu_seconds(gateway.pid) - before) / (rate * duration) * 1e3
    finally:
        pool.close()
        gateway.terminate()
        try:
            gateway.wait(10)
        except subprocess.TimeoutExpired:
            gateway.kill()


async def run(args: argparse.Namespace) -> None:
    engines = start_engines(4)
    trees = {"this checkout": HERE, "baseline": args.baseline_checkout.resolve()}
    ratios = []
    try:
        await wait_healthy(engines)
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{'pair':>4s} {'this ms':>9s} {'baseline ms':>12s} {'ratio':>7s}")
            for i in range(args.pairs):
                order = list(trees) if i % 2 == 0 else list(reversed(trees))
                figures = {
                    name: await cpu_per_request(
                        trees[name], engines, Path(tmp), args.duration, args.concurrency
                    )
                    for name in order
                }
                ratio = figures["this checkout"] / figures["baseline"]
                ratios.append(ratio)
                print(f"{i + 1:4d} {figures['this checkout']:9.3f} {figures['baseline']:12.3f} {ratio:7.2f}",
                      flush=True)  # fmt: skip
    finally:
        stop_engines(engines)
    median = statistics.median(ratios)
    print(f"CPU per request at c={args.concurrency}, this checkout / baseline: median {median:.2f} "
          f"(pairs {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline-checkout", type=Path, required=True, help="another kvgate source tree")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of load per gateway")
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    if not (args.baseline_checkout / "gateway").is_dir():
        parser.error(f"{args.baseline_checkout} is not a kvgate source tree (no gateway/ in it)")
    install_best_loop()
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
