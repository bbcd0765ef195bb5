"""The engine core in a process of its own against the engine on a thread (``kvgate engine --engine-core``),
on the same tiny random model and CPU.

    python tests/bench/bench_engine_core.py [--rounds 3] [--streams 16] [--new-tokens 128]

Each round starts one server per mode (a fresh ``python -m engine engine`` process; the order alternates
between rounds) and, against it: ``--streams`` streaming requests decode ``--new-tokens`` tokens each
(greedy, ``ignore_eos``, 128-token prompts as token ids) while long NEW prompts keep arriving as text
(``--arrival-words`` words each, every ``--arrival-ms``, max_tokens 1): tokenizing and HTTP work that the
split takes off the step loop. Figures: the decode streams' output tokens/s over the wall time and their
inter-token gap p50/p90, and the arriving prompts' TTFT p50/p90. Printed as the median over rounds with
its range, and the process mode's ratio to the thread mode's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "river", "stone", "cloud", "north", "metal")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def start_engine(model: Path, mode: str) -> tuple[asyncio.subprocess.Process, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "engine", "engine", "--model", str(model), "--port", str(port)]
    argv += ["--device", "cpu", "--block-size", "16", "--kv-blocks", "4096", "--engine-core", mode]
    proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    line = (await asyncio.wait_for(proc.stderr.readline(), 120)).decode()
    if "serving" not in line:
        raise SystemExit(f"the {mode} engine did not start: {line}")
    return proc, f"http://127.0.0.1:{port}"


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[float]:
    """The arrival time of each SSE event that carries text or a finish."""
    times = []
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


async def workload(url: str, args: argparse.Namespace, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        warm = {"prompt": "warm up", "max_tokens": 4, "temperature": 0}
        await stream(session, url, warm)
        decode = [
            {
                "prompt_token_ids": [rng.randrange(3, 500) for _ in range(128)],
                "prompt": "x",
                "max_tokens": args.new_tokens,
                "ignore_eos": True,
                "temperature": 0,
            }
            for _ in range(args.streams)
        ]
        started = time.perf_counter()
        streams = [asyncio.create_task(stream(session, url, body)) for body in decode]
        ttfts: list[float] = []

        async def arrive() -> None:
            text = " ".join(rng.choice(WORDS) for _ in range(args.arrival_words))
            sent = time.perf_counter()
            times = await stream(session, url, {"prompt": text, "max_tokens": 1, "temperature": 0})
            ttfts.append(times[0] - sent)

        arrivals: list[asyncio.Task[None]] = []
        while not all(s.done() for s in streams):
            arrivals.append(asyncio.create_task(arrive()))
            await asyncio.sleep(args.arrival_ms / 1000)
        results = [s.result() for s in streams]
        wall = max(t[-1] for t in results) - started
        await asyncio.gather(*arrivals)
    gaps = [b - a for t in results for a, b in itertools.pairwise(t)]
    return {
        "decode tok/s": args.streams * args.new_tokens / wall,
        "gap p50 ms": 1000 * percentile(gaps, 0.5),
        "gap p90 ms": 1000 * percentile(gaps, 0.9),
        "arrival TTFT p50 ms": 1000 * percentile(ttfts, 0.5),
        "arrival TTFT p90 ms": 1000 * percentile(ttfts, 0.9),
        "arrivals": float(len(ttfts)),
    }


async def main(args: argparse.Namespace) -> None:
    from engine.make_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "tiny", "tiny", arch="llama", seed=0, dtype="float32")
        samples: dict[str, list[dict[str, float]]] = {"thread": [], "process": []}
        for r in range(args.rounds):
            for mode in ("thread", "process") if r % 2 == 0 else ("process", "thread"):
                proc, url = await start_engine(model, mode)
                try:
                    samples[mode].append(await workload(url, args, seed=r))
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        proc.terminate()
                    await proc.wait()
                print(f"round {r + 1} {mode}: {orjson.dumps(samples[mode][-1]).decode()}", flush=True)
    higher = {"decode tok/s"}
    print(
        f"\n{'figure':<22}{'thread: median [range]':>28}{'process: median [range]':>28}",
        f"{'process/thread':>16}",
        sep="",
    )
    for key in samples["thread"][0]:
        t = [s[key] for s in samples["thread"]]
        p = [s[key] for s in samples["process"]]
        ratio = statistics.median(p) / statistics.median(t)
        better = "" if key == "arrivals" else (" better" if (ratio > 1) == (key in higher) else " worse")
        print(
            f"{key:<22}{statistics.median(t):>12.1f} [{min(t):.1f}-{max(t):.1f}]".ljust(50)
            + f"{statistics.median(p):>12.1f} [{min(p):.1f}-{max(p):.1f}]".ljust(28)
            + f"{ratio:>10.2f}x{better}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--arrival-words", type=int, default=300, help="words per arriving prompt")
    parser.add_argument("--arrival-ms", type=float, default=200.0)
    asyncio.run(main(parser.parse_args()))
