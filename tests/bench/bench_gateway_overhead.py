"""What the gateway adds to a request: the same requests straight to a simulated engine and through the
gateway, interleaved in one run (A B A B ...), reported as differences and ratios against direct.

    python tests/bench/bench_gateway_overhead.py [--redis redis://127.0.0.1:6379/0] [--rounds 5]

Engines are zero-cost simulators (pure HTTP), each in its own process, as is the gateway; the load
generator is a lean keep-alive client. Measures added p50/p99 latency at concurrency 1 (non-streaming and
time to first byte of a stream) and throughput at concurrency 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.loop import install_best_loop
from gateway.upstream import UpstreamPool

MODEL = "kvgate-sim"
SYSTEM = "You are a helpful assistant. " * 60  # ~1.7 kB: a realistic system prompt to tokenize and hash


def body(i: int, *, stream: bool = False) -> bytes:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"question number {i % 50}"}]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream})


def start_engines(count: int) -> list[EngineProcess]:
    engines = []
    for i in range(count):
        port = free_port()
        cmd = [
            sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL, "--engine-id", f"bench/e{i}",
            "--prefill-s-per-token", "0", "--decode-s-per-token", "0", "--max-running", "1024",
        ]  # fmt: skip
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engines.append(EngineProcess("bench", f"e{i}", port, process))
    return engines


def start_gateway(engines: list[EngineProcess], redis_url: str | None, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    engine_lines = ",\n".join(f'  {{ name = "{e.name}", url = "{e.url}", model = "{MODEL}" }}' for e in engines)
    redis_line = f'redis_url = "{redis_url}"\nredis_prefix = "kvgate-bench-{os.getpid()}"' if redis_url else ""
    config = workdir / "bench.toml"
    config.write_text(
        f'region = "bench"\n[[regions]]\nname = "bench"\nengines = [\n{engine_lines}\n]\n'
        f'[gateway]\nport = {port}\n{redis_line}\n'
    )
    cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "warning", "serve", "--config", str(config)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL), port


async def one(pool: UpstreamPool, payload: bytes, *, first_byte: bool = False) -> float:
    start = time.perf_counter()
    response = await pool.request("POST", "/v1/chat/completions", payload, [("Content-Type", "application/json")])
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
    if first_byte:
        await response.next_batch(30)
        elapsed = time.perf_counter() - start
        await response.read(30)
        return elapsed
    await response.read(30)
    return time.perf_counter() - start


async def latency_round(pools: dict[str, UpstreamPool], n: int, stream: bool) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in pools}
    for i in range(n):
        for name, pool in pools.items():  # A B A B: both see the same machine state
            samples[name].append(await one(pool, body(i, stream=stream), first_byte=stream))
    return samples


async def throughput_round(pool: UpstreamPool, concurrency: int, duration_s: float) -> float:
    done = 0
    deadline = time.perf_counter() + duration_s

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < deadline:
            await one(pool, body(i))
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(direct_port: int, gateway_port: int, rounds: int, n: int, concurrency: int, duration_s: float) -> dict:
    pools = {"direct": UpstreamPool("127.0.0.1", direct_port), "gateway": UpstreamPool("127.0.0.1", gateway_port)}
    for pool in pools.values():  # warm up connections, caches and the gateway's view
        for i in range(200):
            await one(pool, body(i))
    lat: dict[str, list[float]] = {"direct": [], "gateway": []}
    ttfb: dict[str, list[float]] = {"direct": [], "gateway": []}
    tput: dict[str, list[float]] = {"direct": [], "gateway": []}
    for _ in range(rounds):
        for name, values in (await latency_round(pools, n, stream=False)).items():
            lat[name].extend(values)
        for name, values in (await latency_round(pools, n // 2, stream=True)).items():
            ttfb[name].extend(values)
        for name in ("direct", "gateway"):
            tput[name].append(await throughput_round(pools[name], concurrency, duration_s))
    for pool in pools.values():
        pool.close()
    return {"latency": lat, "ttfb": ttfb, "throughput": tput}


def report(results: dict, label: str, concurrency: int) -> dict:
    lat, ttfb, tput = results["latency"], results["ttfb"], results["throughput"]
    d50, g50 = statistics.median(lat["direct"]) * 1e3, statistics.median(lat["gateway"]) * 1e3
    d99, g99 = pct(lat["direct"], 0.99) * 1e3, pct(lat["gateway"], 0.99) * 1e3
    s50, t50 = statistics.median(ttfb["direct"]) * 1e3, statistics.median(ttfb["gateway"]) * 1e3
    dt, gt = statistics.median(tput["direct"]), statistics.median(tput["gateway"])
    summary = {
        "setup": label,
        "added_p50_ms": round(g50 - d50, 3),
        "added_p99_ms": round(g99 - d99, 3),
        "added_stream_ttfb_p50_ms": round(t50 - s50, 3),
        "throughput_ratio": round(gt / dt, 3),
        "direct_p50_ms": round(d50, 3),
        "gateway_p50_ms": round(g50, 3),
        "direct_rps": round(dt, 1),
        "gateway_rps": round(gt, 1),
    }
    print(f"\n== {label}")
    print(f"  concurrency 1, non-streaming: p50 direct {d50:.3f} ms, via gateway {g50:.3f} ms -> added {g50 - d50:+.3f} ms")
    print(f"                                p99 direct {d99:.3f} ms, via gateway {g99:.3f} ms -> added {g99 - d99:+.3f} ms")
    print(f"  concurrency 1, streaming TTFB: p50 direct {s50:.3f} ms, via gateway {t50:.3f} ms -> added {t50 - s50:+.3f} ms")
    print(f"  concurrency {concurrency} throughput: direct {dt:.0f} req/s, via gateway {gt:.0f} req/s -> ratio {gt / dt:.2f}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default=None, help="also run with the gateway's shared state in this Redis")
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per path per latency round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per throughput round")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON too")
    args = parser.parse_args()
    install_best_loop()
    engines = start_engines(args.engines)
    summaries = []
    try:
        asyncio.run(wait_healthy(engines))
        setups = [("embedded (no Redis)", None)] + ([("Redis configured", args.redis)] if args.redis else [])
        for label, redis_url in setups:
            with tempfile.TemporaryDirectory() as tmp:
                gateway, port = start_gateway(engines, redis_url, Path(tmp))
                try:
                    asyncio.run(wait_healthy([EngineProcess("gw", "gw", port, gateway)]))
                    results = asyncio.run(
                        measure(engines[0].port, port, args.rounds, args.requests, args.concurrency, args.duration)
                    )
                    summaries.append(report(results, label, args.concurrency))
                finally:
                    gateway.terminate()
                    gateway.wait(10)
    finally:
        stop_engines(engines)
    if args.json:
        print(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
