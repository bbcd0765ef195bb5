"""A flood: 1,000 concurrent streaming requests, straight to simulated engines and through the gateway, and
the gateway's memory before and after 10,000 requests.

    python tests/bench/bench_flood.py [--concurrency 1000] [--requests 10000] [--engines 4]

Engines are simulated (``python -m engine.sim``, each in its own process) with a small decode cost, so a
stream lasts a while and the concurrency is real; the gateway runs as ``kvgate serve`` in its own process.
Each phase sends the same requests with the same client: direct (round robin over the engines) first, then
through the gateway. Reports errors (any non-200, or a stream that does not end in ``[DONE]``), time to first
byte and end-to-end latency p50/p99 of both, the gateway's additions, and the gateway's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

import orjson
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import pct, start_gateway

from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.upstream import UpstreamPool

MODEL = "kvgate-sim"
SYSTEM = "You are a helpful assistant. " * 40


def body(i: int) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question {i % 500}"}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True})


def start_engines(count: int, decode_s: float) -> list[EngineProcess]:
    import subprocess

    engines = []
    for i in range(count):
        port = free_port()
        cmd = [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL,
               "--engine-id", f"bench/e{i}", "--prefill-s-per-token", "0",
               "--decode-s-per-token", str(decode_s), "--max-running", "100000"]  # fmt: skip
        engines.append(EngineProcess("bench", f"e{i}", port, subprocess.Popen(cmd, stdin=subprocess.DEVNULL)))
    return engines


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def one(
    pool: UpstreamPool, payload: bytes, extra_headers: tuple[tuple[str, str], ...] = ()
) -> tuple[float, float]:
    """(time to first byte, time to the end) of one streamed answer; raises on any error."""
    start = time.perf_counter()
    headers = [("Content-Type", "application/json"), *extra_headers]
    response = await pool.request("POST", "/v1/chat/completions", payload, headers, header_timeout=60)
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}")
    first = await response.next_batch(60)
    ttfb = time.perf_counter() - start
    rest = await response.read(60)
    if not (first or b"").endswith(b"[DONE]\n\n") and not rest.endswith(b"data: [DONE]\n\n"):
        raise RuntimeError("stream ended without [DONE]")
    return ttfb, time.perf_counter() - start


async def flood(pools: list[UpstreamPool], concurrency: int, total: int, label: str = "") -> dict[str, float]:
    """``total`` requests, ``concurrency`` of them in flight at every moment (with a bar when labelled)."""
    bar = tqdm(total=total, desc=label, file=sys.stderr, disable=not label, leave=False)
    ttfb: list[float] = []
    e2e: list[float] = []
    errors = 0
    counter = itertools.count()
    picks = itertools.cycle(pools)

    async def worker() -> None:
        nonlocal errors
        while (i := next(counter)) < total:
            try:
                a, b = await one(next(picks), body(i))
                ttfb.append(a)
                e2e.append(b)
            except Exception:
                errors += 1
            bar.update()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    bar.close()
    return {"requests": total, "errors": errors, "req_s": total / wall,
            "ttfb_p50_ms": pct(ttfb, 0.5) * 1e3, "ttfb_p99_ms": pct(ttfb, 0.99) * 1e3,
            "e2e_p50_ms": pct(e2e, 0.5) * 1e3, "e2e_p99_ms": pct(e2e, 0.99) * 1e3}  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, object]:
    engines = start_engines(args.engines, args.decode_s)
    with tempfile.TemporaryDirectory() as tmp:
        gateway, port = start_gateway(engines, None, Path(tmp))
        try:
            await wait_healthy([*engines, EngineProcess("bench", "gateway", port, gateway)], timeout_s=60)
            direct = [UpstreamPool("127.0.0.1", e.port, max_idle=args.concurrency) for e in engines]
            through = [UpstreamPool("127.0.0.1", port, max_idle=args.concurrency)]
            # Warm-up of both paths at full concurrency: connections open, as in a gateway that has been up
            # a while (a cold burst of 1,000 new connections is a different measurement).
            await flood(direct, args.concurrency, args.concurrency)
            await flood(through, args.concurrency, args.concurrency)
            rss_before = rss_mb(gateway.pid)
            results = {
                "direct": await flood(direct, args.concurrency, args.concurrency * 3, "direct"),
                "gateway": await flood(through, args.concurrency, args.requests, "through the gateway"),
            }
            rss_after = rss_mb(gateway.pid)
            await flood(through, args.concurrency, args.requests, "as many again")  # does memory level off?
            results["gateway_rss_mb"] = {
                "before": rss_before,
                "after": rss_after,
                "after_twice": rss_mb(gateway.pid),
                "after_requests": args.requests,
            }
            for pool in [*direct, *through]:
                pool.close()
            return results
        finally:
            gateway.terminate()
            gateway.wait(30)
            stop_engines(engines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10_000, help="requests through the gateway")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--decode-s", type=float, default=0.01, help="simulated seconds per output token")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    install_best_loop()
    raise_open_file_limit()
    results = asyncio.run(run(args))
    d, g = results["direct"], results["gateway"]
    assert isinstance(d, dict) and isinstance(g, dict)
    per_token_ms = args.decode_s * 1e3
    print(
        f"{args.concurrency} concurrent streams, {args.engines} simulated engines, {per_token_ms:.0f} ms/tok"
    )
    columns = ("requests", "errors", "req/s", "TTFB p50", "p99", "e2e p50", "p99")
    print(f"{'path':8s} " + " ".join(f"{c:>9s}" for c in columns))
    for name, r in (("direct", d), ("gateway", g)):
        print(f"{name:8s} {r['requests']:9d} {r['errors']:9d} {r['req_s']:9.0f} {r['ttfb_p50_ms']:7.1f}ms "
              f"{r['ttfb_p99_ms']:7.1f}ms {r['e2e_p50_ms']:7.1f}ms {r['e2e_p99_ms']:7.1f}ms")  # fmt: skip
    print(
        f"added by the gateway: TTFB p99 {g['ttfb_p99_ms'] - d['ttfb_p99_ms']:+.1f} ms, "
        f"e2e p99 {g['e2e_p99_ms'] - d['e2e_p99_ms']:+.1f} ms (ratio {g['e2e_p99_ms'] / d['e2e_p99_ms']:.2f})"
    )
    rss = results["gateway_rss_mb"]
    assert isinstance(rss, dict)
    print(f"gateway RSS: {rss['before']:.1f} MB before, {rss['after']:.1f} MB after "
          f"{rss['after_requests']} requests ({rss['after'] - rss['before']:+.1f} MB), "
          f"{rss['after_twice']:.1f} MB after as many again")  # fmt: skip
    if args.json:
        print(json.dumps(results, indent=1))
    return 0 if d["errors"] == 0 and g["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
