"""Where the gateway's CPU goes per request, function by function: the gateway under cProfile, in front of
zero-cost simulated engines, at ``--concurrency`` for ``--seconds`` (bench_gateway_overhead's chat request).

    python tests/bench/profile_gateway.py [--concurrency 32] [--seconds 10] [--top 40] [--stream]
        [--sort tottime|cumtime|ncalls] [--out FILE]

Prints the Python function calls per request (the figure the hot-path work of issue 26 reduces) and the
``--top`` functions by ``--sort``, each with its calls and microseconds per request. cProfile slows every
call down by a roughly constant amount, so the microseconds are inflated and read as shares; the call counts
are exact. ``--out`` keeps the raw pstats file (``python -m pstats FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import pstats
import signal
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway_overhead as overhead
from bench_gateway_overhead import start_engines, start_gateway, throughput_round

from gateway.demo import EngineProcess, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop
from gateway.http.upstream import UpstreamPool


async def load(port: int, concurrency: int, seconds: float, stream: bool) -> int:
    pool = UpstreamPool("127.0.0.1", port)
    try:
        # Warm-up, then the measured part: only the total count matters (cProfile counts both).
        make = (lambda i: overhead.body(i, stream=True)) if stream else None
        warm = await throughput_round(pool, concurrency, 1.0, make)
        measured = await throughput_round(pool, concurrency, seconds, make)
        return round(warm * 1.0 + measured * seconds)
    finally:
        pool.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--sort", default="tottime", choices=("tottime", "cumtime", "ncalls"))
    parser.add_argument("--stream", action="store_true", help="streamed answers (default: whole ones)")
    parser.add_argument("--out", type=Path, help="keep the pstats file here")
    args = parser.parse_args()
    install_best_loop()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        stats_file = args.out or workdir / "gateway.pstats"
        engines = start_engines(4)
        gateway, port = start_gateway(
            engines, None, workdir, python_args=["-m", "cProfile", "-o", str(stats_file)]
        )
        try:
            asyncio.run(wait_healthy([EngineProcess("bench", "gateway", port, gateway), *engines]))
            requests = asyncio.run(load(port, args.concurrency, args.seconds, args.stream))
        finally:
            gateway.send_signal(signal.SIGINT)  # cProfile writes its file as the process exits
            gateway.wait(30)
            stop_engines(engines)
        stats = pstats.Stats(str(stats_file))
        table = stats.stats  # type: ignore[attr-defined]  # {(file, line, name): (cc, nc, tt, ct, callers)}
        total_calls = sum(nc for _, nc, _, _, _ in table.values())
        profiled_us = stats.total_tt / requests * 1e6  # type: ignore[attr-defined]
        print(f"{requests} requests at c={args.concurrency}; {total_calls / requests:.0f} function calls per "
              f"request (start-up included), {profiled_us:.0f} us profiled CPU per request")  # fmt: skip
        column = {"ncalls": 1, "tottime": 2, "cumtime": 3}[args.sort]
        rows = sorted(table.items(), key=lambda kv: kv[1][column], reverse=True)[: args.top]
        print(f"{'calls/req':>9s} {'tot us/req':>10s} {'cum us/req':>10s}  function")
        for (file, line, name), (_, nc, tt, ct, _) in rows:
            where = f"{Path(file).parent.name}/{Path(file).name}:{line}" if line else file
            per = (nc / requests, tt / requests * 1e6, ct / requests * 1e6)
            print(f"{per[0]:9.2f} {per[1]:10.1f} {per[2]:10.1f}  {name} ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
