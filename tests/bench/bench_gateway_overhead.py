"""What the gateway adds to a request: the same requests straight to a simulated engine and through the
gateway, interleaved in one run (A B A B ...), reported as differences and ratios against direct.

    python tests/bench/bench_gateway_overhead.py [--redis URL] [--rounds 5] [--sessions N] [--workers 1,2]

Engines are zero-cost simulators (pure HTTP), each in its own process, as is the gateway; the load
generator is a lean keep-alive client. Measures added p50/p99 latency at concurrency 1 (non-streaming and
time to first byte of a stream) and throughput at concurrency 32. With ``--sessions N`` every request carries
``x-session-affinity`` (N sessions in turn, all bound during the warm-up): the path of a session already
bound in the gateway's view, which must not wait on Redis. ``--workers 1,2`` runs every setup once per
count of gateway processes (``kvgate serve --workers N``; CPU then counts the workers, and without Redis
their private redis-server). A bare relay (relay_floor.py: the same server stack and upstream client, no
parsing, hashing or routing) runs beside it as the floor any Python proxy on this machine pays, so the
gateway's own cost reads as "gateway - floor"; each process's CPU per request is read from /proc (Linux
only). ``--baseline-checkout DIR`` runs a second gateway from another source tree (``git worktree add DIR
COMMIT``) as ``gateway@base`` beside the first: before and after a change, as same-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop
from gateway.http.upstream import UpstreamPool

MODEL = "kvgate-sim"
SYSTEM = ["You are a helpful assistant. " * 60]  # ~1.7 kB: a realistic system prompt to tokenize and hash
SESSIONS = [0]  # --sessions: requests carry x-session-affinity, this many sessions in turn (0: none)
_SENT = itertools.count()


def body(i: int, *, stream: bool = False) -> bytes:
    messages = [
        {"role": "system", "content": SYSTEM[0]},
        {"role": "user", "content": f"question number {i % 50}"},
    ]
    return orjson.dumps({"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream})


def start_engines(count: int) -> list[EngineProcess]:
    engines = []
    for i in range(count):
        port = free_port()
        cmd = [
            sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL,
            "--engine-id", f"bench/e{i}", "--prefill-s-per-token", "0", "--decode-s-per-token", "0",
            "--max-running", "1024",
        ]  # fmt: skip
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engines.append(EngineProcess("bench", f"e{i}", port, process))
    return engines


def start_gateway(
    engines: list[EngineProcess],
    redis_url: str | None,
    workdir: Path,
    *,
    workers: int = 1,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    python_args: Sequence[str] = (),
) -> tuple[subprocess.Popen[bytes], int]:
    """A gateway in front of ``engines`` (its own process, ``env`` its environment: None, this one's). It
    runs ``python [python_args] -m gateway.cli``, which imports kvgate from ``cwd`` (default: this
    process's) before any PYTHONPATH entry: to run another source tree, pass ``tree_launch(tree)``."""
    port = free_port()
    engine_lines = ",\n".join(
        f'  {{ name = "{e.name}", url = "{e.url}", model = "{MODEL}" }}' for e in engines
    )
    redis_line = (
        f'redis_url = "{redis_url}"\nredis_prefix = "kvgate-bench-{os.getpid()}"' if redis_url else ""
    )
    config = workdir / f"bench-{port}.toml"
    config.write_text(
        f'region = "bench"\n[[regions]]\nname = "bench"\nengines = [\n{engine_lines}\n]\n'
        f"[gateway]\nport = {port}\n{redis_line}\n"
        f'spool_path = "{workdir / f"spool-{port}"}"\n'  # (and the workers' private Redis beside it)
    )
    cmd = [sys.executable, *python_args, "-m", "gateway.cli", "--log-level", "warning", "serve", "--config",
           str(config)]  # fmt: skip
    if workers > 1:
        cmd += ["--workers", str(workers)]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=env, cwd=cwd), port


def tree_launch(tree: Path) -> dict[str, Any]:
    """How to start ``python -m ...`` so that it imports kvgate from ``tree``: from there as its working
    directory (``gateway`` is a namespace package, and ``-m`` puts the working directory first on sys.path,
    before PYTHONPATH and the editable install), with ``tree`` on PYTHONPATH for the processes it starts."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    return {"cwd": tree, "env": {**os.environ, "PYTHONPATH": path}}


async def one(pool: UpstreamPool, payload: bytes, *, first_byte: bool = False) -> float:
    headers = [("Content-Type", "application/json")]
    if SESSIONS[0]:
        headers.append(("x-session-affinity", f"bench-{next(_SENT) % SESSIONS[0]}"))
    start = time.perf_counter()
    response = await pool.request("POST", "/v1/chat/completions", payload, headers)
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


async def throughput_round(
    pool: UpstreamPool, concurrency: int, duration_s: float, make_body: Callable[[int], bytes] | None = None
) -> float:
    """Requests per second with ``concurrency`` requests always in flight for ``duration_s``."""
    make_body = make_body or body
    done = 0
    deadline = time.perf_counter() + duration_s

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.perf_counter() < deadline:
            await one(pool, make_body(i))
            done += 1
            i += concurrency

    start = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done / (time.perf_counter() - start)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


PATHS = ("direct", "floor", "floor (httptools)", "gateway")
BASE = "gateway@base"  # --baseline-checkout's


def start_floor(engine_port: int, *, httptools: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    script = Path(__file__).with_name("relay_floor.py")
    flags = ["--httptools"] if httptools else []
    return subprocess.Popen(
        [sys.executable, str(script), str(port), str(engine_port), *flags], stdin=subprocess.DEVNULL
    ), port


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process and its live descendants have used (``--workers``: the workers and
    their private Redis too; Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return float("nan")
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) for child in children)


async def measure(
    ports: dict[str, int], pids: dict[str, int], rounds: int, n: int, concurrency: int, duration_s: float
) -> dict[str, Any]:
    pools = {name: UpstreamPool("127.0.0.1", port) for name, port in ports.items()}
    for pool in pools.values():  # warm up connections, caches and the gateway's view
        for i in range(200):
            await one(pool, body(i))
    lat: dict[str, list[float]] = {name: [] for name in pools}
    ttfb: dict[str, list[float]] = {name: [] for name in pools}
    tput: dict[str, list[float]] = {name: [] for name in pools}
    # CPU seconds and requests per process, at c=1 (both latency rounds) and at c=32.
    cpu = {phase: {name: [0.0, 0] for name in pids} for phase in ("c1", "c32")}
    for _ in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        for name, values in (await latency_round(pools, n, stream=False)).items():
            lat[name].extend(values)
        for name, values in (await latency_round(pools, n // 2, stream=True)).items():
            ttfb[name].extend(values)
        for name, pid in pids.items():
            cpu["c1"][name][0] += cpu_seconds(pid) - before[name]
            cpu["c1"][name][1] += n + n // 2
        for name in pools:
            start_cpu = cpu_seconds(pids[name]) if name in pids else 0.0
            rate = await throughput_round(pools[name], concurrency, duration_s)
            tput[name].append(rate)
            if name in pids:
                cpu["c32"][name][0] += cpu_seconds(pids[name]) - start_cpu
                cpu["c32"][name][1] += round(rate * duration_s)
    for pool in pools.values():
        pool.close()
    cpu_ms = {phase: {k: s / max(1, count) * 1e3 for k, (s, count) in v.items()} for phase, v in cpu.items()}
    return {"latency": lat, "ttfb": ttfb, "throughput": tput, "cpu_ms": cpu_ms}


def report(results: dict[str, Any], label: str, concurrency: int) -> dict[str, Any]:
    lat, ttfb, tput = results["latency"], results["ttfb"], results["throughput"]
    p50 = {k: statistics.median(v) * 1e3 for k, v in lat.items()}
    p99 = {k: pct(v, 0.99) * 1e3 for k, v in lat.items()}
    s50 = {k: statistics.median(v) * 1e3 for k, v in ttfb.items()}
    rps = {k: statistics.median(v) for k, v in tput.items()}
    cpu = results["cpu_ms"]
    d = "direct"
    summary = {
        "setup": label,
        "added_p50_ms": round(p50["gateway"] - p50[d], 3),
        "added_p99_ms": round(p99["gateway"] - p99[d], 3),
        "added_stream_ttfb_p50_ms": round(s50["gateway"] - s50[d], 3),
        "throughput_ratio": round(rps["gateway"] / rps[d], 3),
        "floor_added_p50_ms": round(p50["floor"] - p50[d], 3),
        "floor_throughput_ratio": round(rps["floor"] / rps[d], 3),
        "gateway_minus_floor_p50_ms": round(p50["gateway"] - p50["floor"], 3),
        "cpu_ms_per_request": cpu,
    }
    print(f"\n== {label}   (added = path - direct, same run, interleaved)")
    print(
        f"  {'':17s} {'p50 ms':>8s} {'added':>8s} {'p99 ms':>8s} {'added':>8s} {'TTFB ms':>8s} {'added':>8s} "
        f"{'req/s c=' + str(concurrency):>12s} {'ratio':>6s}"
    )
    for k in [path for path in (*PATHS, BASE) if path in p50]:
        print(
            f"  {k:17s} {p50[k]:8.3f} {p50[k] - p50[d]:+8.3f} {p99[k]:8.3f} {p99[k] - p99[d]:+8.3f} "
            f"{s50[k]:8.3f} {s50[k] - s50[d]:+8.3f} {rps[k]:12.0f} {rps[k] / rps[d]:6.2f}"
        )
    print(f"  gateway - floor (the gateway's own work), p50: {p50['gateway'] - p50['floor']:+.3f} ms")
    print("  CPU per request (ms):  " + "  ".join(f"{k} c=1 {cpu['c1'][k]:.3f} c={concurrency} "
                                                  f"{cpu['c32'][k]:.3f}" for k in cpu["c1"]))  # fmt: skip
    if BASE in p50:
        new, old = p50["gateway"] - p50[d], p50[BASE] - p50[d]
        summary["base"] = {
            "added_p50_ms": round(old, 3),
            "throughput_ratio": round(rps[BASE] / rps[d], 3),
        }
        print(
            f"  gateway / gateway@base: added p50 {new / old:.2f}, "
            f"throughput {rps['gateway'] / rps[BASE]:.2f}, "
            f"CPU per request c=1 {cpu['c1']['gateway'] / cpu['c1'][BASE]:.2f}, "
            f"c={concurrency} {cpu['c32']['gateway'] / cpu['c32'][BASE]:.2f}"
        )
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--redis", default=None, help="also run with the gateway's shared state in this Redis"
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per path per latency round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=3.0, help="seconds per throughput round")
    parser.add_argument("--system-chars", type=int, default=1700, help="length of the system prompt (bytes)")
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON too")
    parser.add_argument(
        "--workers",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1],
        help="gateway processes (kvgate serve --workers), one setup per count: e.g. 1,2",
    )
    parser.add_argument(
        "--sessions", type=int, default=0, help="send x-session-affinity, this many sessions in turn"
    )
    parser.add_argument(
        "--baseline-checkout", type=Path, default=None, help="also run a gateway from this source tree"
    )
    args = parser.parse_args()
    SYSTEM[0] = ("You are a helpful assistant. " * (args.system_chars // 28 + 1))[: args.system_chars]
    install_best_loop()
    SESSIONS[0] = args.sessions
    engines = start_engines(args.engines)
    summaries = []
    try:
        asyncio.run(wait_healthy(engines))
        setups = [
            (f"{label}, {n} worker{'s' if n > 1 else ''}", redis_url, n)
            for n in args.workers
            for label, redis_url in [("embedded (no Redis)", None)]
            + ([("Redis configured", args.redis)] if args.redis else [])
        ]
        for label, redis_url, workers in setups:
            with tempfile.TemporaryDirectory() as tmp:
                gateway, port = start_gateway(engines, redis_url, Path(tmp), workers=workers)
                floor, floor_port = start_floor(engines[0].port)
                bare, bare_port = start_floor(engines[0].port, httptools=True)
                processes = {"gateway": (gateway, port), "floor": (floor, floor_port),
                             "floor (httptools)": (bare, bare_port)}  # fmt: skip
                if args.baseline_checkout is not None:
                    tree = args.baseline_checkout.resolve()
                    processes[BASE] = start_gateway(
                        engines, redis_url, Path(tmp), workers=workers, **tree_launch(tree)
                    )
                try:
                    asyncio.run(
                        wait_healthy(
                            [EngineProcess("gw", name, p, proc) for name, (proc, p) in processes.items()]
                        )
                    )
                    ports = {"direct": engines[0].port, **{name: p for name, (_, p) in processes.items()}}
                    pids = {name: proc.pid for name, (proc, _) in processes.items()}
                    results = asyncio.run(
                        measure(ports, pids, args.rounds, args.requests, args.concurrency, args.duration)
                    )
                    summaries.append(report(results, label, args.concurrency))
                finally:
                    for process, _ in processes.values():
                        process.terminate()
                        process.wait(10)
    finally:
        stop_engines(engines)
    if args.json:
        print(json.dumps(summaries, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
