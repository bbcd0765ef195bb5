"""Gateway CPU per request, this checkout against another, in front of the same engines, in one run.

    python tests/bench/bench_cpu_ab.py --baseline-checkout DIR [--rounds 4] [--seconds 5]

``DIR`` is another checkout of kvgate (``git worktree add DIR COMMIT``). Both gateways run as processes of
their own (``kvgate serve``, bench_routers' configuration) in front of 4 zero-cost simulated engines; rounds
alternate which goes first. Each round keeps 32 of bench_routers' chat requests in flight for ``--seconds``
and reads the gateway's CPU time (user + system, /proc) before and after: CPU per request is that over the
requests it routed (its own ``kvgate_routing_decisions_total``), which also gives the spread over engines.
Prints each round, then the medians. What it isolates: the gateway's own work per request, without the
client's or the engines' time that the throughput ratio of bench_routers mixes in on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import cpu_seconds, one, throughput_round
from bench_routers import byte_tokenizer_dir, chat_body, start_engines, start_kvgate, wait_ready

from gateway.http.upstream import UpstreamPool

DECISIONS = re.compile(r'kvgate_routing_decisions_total\{[^}]*engine="([^"]+)"[^}]*\} ([0-9.e+]+)')


def decisions(port: int) -> dict[str, float]:
    """Requests routed so far, per engine."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for engine, count in DECISIONS.findall(text):
        out[engine] = out.get(engine, 0.0) + float(count)
    return out


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tok = byte_tokenizer_dir(Path(tmp) / "tokenizer")
        engines = start_engines(4, tok, prefill_s=0.0, decode_s=0.0, capacity=64000)
        gateways = [start_kvgate(engines, tok, Path(tmp)),
                    start_kvgate(engines, tok, Path(tmp), checkout=args.baseline_checkout)]  # fmt: skip
        try:
            for g in gateways:
                if not await wait_ready(g):
                    raise SystemExit(f"{g.name} did not become ready")
            pools = {g.name: UpstreamPool("127.0.0.1", g.port, max_idle=32) for g in gateways}
            for pool in pools.values():
                for i in range(200):
                    await one(pool, chat_body(i))
            figures: dict[str, list[tuple[float, float]]] = {g.name: [] for g in gateways}
            for n in range(args.rounds):
                for g in gateways if n % 2 == 0 else gateways[::-1]:
                    cpu0, before = cpu_seconds(g.process.pid), decisions(g.port)
                    rps = await throughput_round(pools[g.name], 32, args.seconds, chat_body)
                    cpu1, after = cpu_seconds(g.process.pid), decisions(g.port)
                    spread = {e: int(after[e] - before.get(e, 0.0)) for e in after}
                    per_request_ms = (cpu1 - cpu0) / sum(spread.values()) * 1e3
                    figures[g.name].append((rps, per_request_ms))
                    print(f"{g.name:12s} {rps:7.0f} req/s  {per_request_ms:.3f} ms CPU/request  {spread}")
            print("\nmedians (min-max)")
            for name, runs in figures.items():
                rps, cpu = [r for r, _ in runs], [c for _, c in runs]
                mid_rps, mid_cpu = statistics.median(rps), statistics.median(cpu)
                print(f"{name:12s} {mid_rps:7.0f} req/s ({min(rps):.0f}-{max(rps):.0f})  "
                      f"{mid_cpu:.3f} ms CPU/request ({min(cpu):.3f}-{max(cpu):.3f})")  # fmt: skip
            for pool in pools.values():
                pool.close()
        finally:
            for process in [g.process for g in gateways] + [e.process for e in engines]:
                process.terminate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline-checkout", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
