"""Does the live bench agree with ``kvgate simulate``? One workload, one cost model, both sides (issue 24).

    python tests/bench/bench_agreement.py [--workload conversation|synthetic] [--requests 260] [--engines 4]
        [--profile llama3-8b-h100] [--profile-overrides K=V,...] [--capacity-trace-blocks 2000]
        [--max-output 32] [--runs 2] [--json]

The workload is the first ``--requests`` requests of a Mooncake trace (``tests/data``: the conversation trace,
or with ``--workload synthetic`` the synthetic one) at the
trace's own time scale (no compression; the trace starts at 0 s, 260 requests last about 86 s), every output
capped at ``--max-output`` tokens on both sides. One region of ``--engines`` engines, each under the same
``perfmodel`` profile:

* live: ``--engines`` simulated engines (``python -m engine.sim --profile NAME``: the batching step loop in
  real time, 16-token blocks, a prefix cache of ``capacity-trace-blocks x 32`` blocks) behind kvgate (its
  default policy, its prefill estimate set to the profile's), the requests sent at their arrival times and
  streamed, each hash id becoming the same 512 bytes (= 512 tokens with the byte tokenizer), with
  ``x-session-affinity`` = the conversation key, as in ``bench_routers`` part 2. Hit rate = the engines'
  reported ``cached_tokens`` / prompt tokens; TTFT = time to the first streamed byte of the answer.
* simulated: ``gateway.simulate.run_simulation`` on the same requests, 1 region x ``--engines`` engines,
  ``capacity_blocks = --capacity-trace-blocks`` (512-token trace blocks), ``profile`` = the same. Its
  ``SimResult.hit_rate`` is in trace blocks; the table's hit rate is in tokens (the ``cached_tokens_read``
  of every executed step, over the prompt tokens), as the live side's is; both are printed.

KV pulls between peers are on, at the same cost on both sides (``--pull-fraction`` of the profile's
prefill cost per token: the engines' ``--kv-pull-s-per-token``, kvgate's ``kv_pull_s_per_token`` and the
simulator's ``CostModel.kv_pull_tokens_per_s``); ``--no-kv-pull`` turns them off on both.

The goal: hit rate within 1 point, TTFT p90 within 10 %.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway_overhead import MODEL
from bench_routers import byte_tokenizer_dir, start_kvgate, wait_ready
from trace_workload import TRACE, block_text, overhead_mean_ms

from engine.sim.config import SimEngineConfig
from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from gateway.http.upstream import UpstreamPool
from gateway.simulate import run_simulation
from perfmodel.batching import StepRecord
from perfmodel.profiles import EngineProfile, parse_overrides, profile, with_overrides
from region_map.simulation.simulator import CostModel, percentile
from region_map.simulation.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

LIVE_BLOCK = 16  # the simulated engine's block size (vLLM's default, the profiles' too)
PER_TRACE_BLOCK = TRACE_BLOCK_TOKENS // LIVE_BLOCK  # 32 live blocks to one trace block
MAX_MODEL_LEN = SimEngineConfig("bench").max_model_len  # the simulated engines' context (Llama 3's 131,072)
WORKLOADS = {"conversation": TRACE, "synthetic": TRACE.with_name("mooncake_synthetic_trace.jsonl.gz")}


def workload(
    n: int, max_output: int | None, path: Path = TRACE, start: int = 0, load: float = 1.0
) -> list[TraceRequest]:
    """``n`` requests of the trace at ``path`` from its ``start``-th (its clock then starts at that one's
    arrival), arriving ``load`` times as fast, outputs capped (the same list feeds both sides), less any
    longer than the simulated engines' context (prompt + output over ``MAX_MODEL_LEN``: the synthetic
    trace's 134,773-token prompt), which every engine would refuse and no router could serve."""
    trace = rebased(load_trace(path, limit=start + n)[start:], load)
    cap = max_output or 1 << 30
    capped = [dataclasses.replace(r, output_tokens=max(1, min(r.output_tokens, cap))) for r in trace]
    return [r for r in capped if r.input_tokens + r.output_tokens <= MAX_MODEL_LEN]


def rebased(requests: list[TraceRequest], load: float = 1.0) -> list[TraceRequest]:
    """``requests`` on a clock that starts at the first one's arrival, arriving ``load`` times as fast."""
    t0 = requests[0].arrival_s if requests else 0.0
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) / load) for r in requests]


def body(r: TraceRequest) -> bytes:
    full, tail = divmod(r.input_tokens, TRACE_BLOCK_TOKENS)
    text = "".join(block_text(b) for b in r.blocks[:full])
    if tail and len(r.blocks) > full:
        text += block_text(r.blocks[full])[:tail]
    return orjson.dumps({"model": MODEL, "prompt": text, "max_tokens": r.output_tokens, "stream": True,
                         "stream_options": {"include_usage": True}})  # fmt: skip


# -- side B: the simulator ---------------------------------------------------------------------------------


def simulated(
    trace: list[TraceRequest],
    engines: int,
    capacity: int,
    prof: EngineProfile,
    pull_s: float,
    policy: str = "default",
) -> dict[str, Any]:
    cached_read = 0
    busy: dict[str, float] = {}  # seconds each engine spent in steps

    def on_step(engine: str, record: StepRecord) -> None:
        nonlocal cached_read
        cached_read += record.cached_tokens_read
        busy[engine] = busy.get(engine, 0.0) + record.duration_s

    cost = CostModel(kv_pull_tokens_per_s=1.0 / pull_s if pull_s > 0 else 0.0)
    result = run_simulation(trace, policy=policy, regions=1, engines_per_region=engines,
                            capacity_blocks=capacity, cost=cost, profile=prof, on_step=on_step)  # fmt: skip
    prompt = sum(max(1, r.input_tokens) for r in trace)
    counts = list(result.per_engine_requests.values())
    # Every engine is listed in per_engine_requests; one that never stepped did no work.
    seconds = [busy.get(e, 0.0) for e in result.per_engine_requests]
    return {
        "busy_max_over_mean": max(seconds) / (sum(seconds) / len(seconds)) if sum(seconds) else 0.0,
        "hit_rate": cached_read / prompt,
        "hit_rate_blocks": result.hit_rate,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p90_s": result.ttft_p90_s,
        "ttft_p99_s": result.ttft_p99_s,
        "load_max_over_mean": max(counts) / (sum(counts) / len(counts)),
        "pull_share": result.pull_share,
        "errors": 0,
    }


# -- side A: live ------------------------------------------------------------------------------------------


def start_engines(
    count: int,
    tokenizer: Path,
    name: str,
    overrides: str,
    capacity_blocks: int,
    pull_s: float,
    ports: list[int] | None = None,
) -> list[EngineProcess]:
    """``count`` simulated batching engines, on ``ports`` (default: free ones)."""
    engines = []
    for i in range(count):
        port = ports[i] if ports else free_port()
        cmd = [sys.executable, "-m", "engine.sim", "--port", str(port), "--model", MODEL,
               "--engine-id", f"bench/e{i}", "--tokenizer", str(tokenizer), "--profile", name,
               "--block-size", str(LIVE_BLOCK), "--capacity-blocks", str(capacity_blocks),
               "--kv-pull-s-per-token", str(pull_s)]  # fmt: skip
        if overrides:
            cmd += ["--profile-overrides", overrides]
        process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        engines.append(EngineProcess("bench", f"e{i}", port, process))
    return engines


async def replay(port: int, trace: list[TraceRequest]) -> dict[str, Any]:
    """Every request at its arrival time (the trace's own clock), streamed; TTFT and cached tokens, overall
    and per request (``cached``: each request's cached tokens, in trace order; -1 for a failed one; behind
    kvgate also ``route``, the reason it gave, and ``predicted``, the cached tokens it expected: "" and -1
    behind the peers, which say neither)."""
    pool = UpstreamPool("127.0.0.1", port, max_idle=512)
    bodies = [body(r) for r in trace]  # built before the clock starts
    ttft: list[float] = []
    per_request = [-1] * len(trace)
    per_ttft = [-1.0] * len(trace)  # each request's TTFT in s (-1: failed), for per-request comparisons
    routes = [""] * len(trace)
    predicted = [-1] * len(trace)
    late: list[float] = []  # how far behind its arrival time each request was sent
    prompt = cached = errors = 0
    bar = tqdm(total=len(trace), desc="live replay", file=sys.stderr, leave=False)
    t0 = time.perf_counter()

    async def send(i: int, r: TraceRequest) -> None:
        nonlocal prompt, cached, errors
        await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
        start = time.perf_counter()
        late.append(start - t0 - r.arrival_s)
        try:
            headers = [("Content-Type", "application/json"), ("x-session-affinity", str(r.conversation))]
            resp = await pool.request("POST", "/v1/completions", bodies[i], headers, header_timeout=300)
            first = await resp.next_batch(300)
            elapsed = time.perf_counter() - start
            routes[i] = (resp.header(b"x-kvgate-route") or b"").decode()
            predicted[i] = int(resp.header(b"x-kvgate-predicted-cached-tokens") or -1)
            data = (first or b"") + await resp.read(300)
            usage = None
            for line in data.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage"' in line:
                    usage = orjson.loads(line[6:]).get("usage") or usage
            if resp.status != 200 or usage is None:
                raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
            ttft.append(elapsed)
            per_ttft[i] = elapsed
            prompt += usage["prompt_tokens"]
            per_request[i] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            cached += per_request[i]
        except Exception as exc:
            errors += 1
            print(f"request {i}: {exc}", file=sys.stderr)
        bar.update()

    await asyncio.gather(*(send(i, r) for i, r in enumerate(trace)))
    bar.close()
    pool.close()
    return {
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt,
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p90_s": percentile(ttft, 0.90),
        "ttft_p99_s": percentile(ttft, 0.99),
        "send_late_p99_ms": percentile(late, 0.99) * 1e3,
        "errors": errors,
        "cached": per_request,
        "ttft_s": per_ttft,
        "route": routes,
        "predicted": predicted,
    }


def max_over_mean(before: list[float], after: list[float]) -> float:
    """The engines' largest share of what they did between two readings of a counter, over the mean."""
    done = [a - b for a, b in zip(after, before, strict=True)]
    return max(done) / (sum(done) / len(done)) if sum(done) else 0.0


async def engine_requests(engines: list[EngineProcess]) -> list[float]:
    from trace_workload import engine_counts

    return await engine_counts(engines)


async def live(args: argparse.Namespace, trace: list[TraceRequest], prof: EngineProfile) -> dict[str, Any]:
    pull_s = prof.prefill_s_per_token * args.pull_fraction if args.kv_pull else 0.0
    with tempfile.TemporaryDirectory() as tmp:
        tok = byte_tokenizer_dir(Path(tmp) / "tokenizer")
        engines = start_engines(args.engines, tok, args.profile, args.profile_overrides,
                                args.capacity_trace_blocks * PER_TRACE_BLOCK, pull_s)  # fmt: skip
        router = None
        try:
            await wait_healthy(engines)
            if not args.kv_pull:
                os.environ["KVGATE_BENCH_ROUTING"] = "kv_pull = false"
            # start_kvgate sets kv_pull_s_per_token to prefill x bench_routers.PULL_FRACTION (0.24): the
            # default --pull-fraction is that same ratio, so kvgate's estimate matches the engines' cost.
            router = start_kvgate(engines, tok, Path(tmp), prof.prefill_s_per_token)
            if not await wait_ready(router):
                raise RuntimeError("kvgate did not become ready")
            before = await engine_requests(engines)
            figures = await replay(router.port, trace)
            figures["load_max_over_mean"] = max_over_mean(before, await engine_requests(engines))
            figures["gateway_overhead_ms"] = await overhead_mean_ms(router.port)
            return figures
        finally:
            if router is not None:
                router.process.terminate()
                router.process.wait(10)
            stop_engines(engines)


# -- main --------------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=260, help="the first N trace requests (260: ~86 s)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="conversation",
                        help="which Mooncake trace of tests/data (see its README.md)")  # fmt: skip
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--profile-overrides", default="", help="FIELD=VALUE,... for both sides")
    parser.add_argument("--capacity-trace-blocks", type=int, default=2000,
                        help="prefix cache per engine, trace blocks (live: x32 16-token blocks)")  # fmt: skip
    parser.add_argument("--max-output", type=int, default=32,
                        help="cap on output tokens, both sides (0: the trace's)")  # fmt: skip
    parser.add_argument("--pull-fraction", type=float, default=0.24, help="KV pull cost / prefill cost")
    parser.add_argument("--no-kv-pull", dest="kv_pull", action="store_false")
    parser.add_argument("--runs", type=int, default=2, help="live runs (the simulation is deterministic)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.kv_pull and abs(args.pull_fraction - 0.24) > 1e-12:
        parser.error("kvgate's pull estimate is fixed at 0.24 x prefill by bench_routers.start_kvgate")
    install_best_loop()
    raise_open_file_limit()
    prof = with_overrides(profile(args.profile), **parse_overrides(args.profile_overrides))
    trace = workload(args.requests, args.max_output or None, WORKLOADS[args.workload])
    pull_s = prof.prefill_s_per_token * args.pull_fraction if args.kv_pull else 0.0
    t = time.perf_counter()
    sim = simulated(trace, args.engines, args.capacity_trace_blocks, prof, pull_s)
    sim["wall_s"] = time.perf_counter() - t
    runs = [asyncio.run(live(args, trace, prof)) for _ in range(args.runs)]

    span = trace[-1].arrival_s - trace[0].arrival_s
    print(f"\nMooncake {args.workload} trace: first {len(trace)} requests over {span:.1f} s (true time), "
          f"outputs capped at {args.max_output or 'the trace'} tokens; 1 region x {args.engines} engines, "
          f"profile {args.profile}{' + ' + args.profile_overrides if args.profile_overrides else ''}; cache "
          f"{args.capacity_trace_blocks} trace blocks/engine; "
          f"KV pulls {'on' if args.kv_pull else 'off'}")  # fmt: skip
    cols = ("hit rate", "TTFT p50", "TTFT p90", "TTFT p99", "max/mean", "errors")
    print(f"{'side':12s} " + " ".join(f"{c:>9s}" for c in cols))

    def row(name: str, r: dict[str, Any]) -> None:
        ttft = " ".join(f"{r[k] * 1e3:7.1f}ms" for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))
        print(f"{name:12s} {r['hit_rate']:9.2%} {ttft} {r['load_max_over_mean']:9.2f} {r['errors']:9d}")

    row("simulate", sim)
    for i, r in enumerate(runs, 1):
        row(f"live #{i}", r)
    keys = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "load_max_over_mean")
    med = {k: statistics.median(r[k] for r in runs) for k in keys} | {
        "errors": sum(r["errors"] for r in runs)
    }
    if len(runs) > 1:
        row("live median", med)
    print(f"simulate: hit rate in trace blocks {sim['hit_rate_blocks']:.2%}, "
          f"pulls {sim['pull_share']:.1%} of requests, {sim['wall_s']:.1f} s to run")  # fmt: skip
    for i, r in enumerate(runs, 1):
        print(f"live #{i}: prompt tokens {r['prompt_tokens']:,} "
              f"(trace {sum(x.input_tokens for x in trace):,}), "
              f"kvgate receive-to-dispatch mean {r['gateway_overhead_ms']:.2f} ms, requests sent late by "
              f"p99 {r['send_late_p99_ms']:.1f} ms")  # fmt: skip
    hit_pts = (med["hit_rate"] - sim["hit_rate"]) * 100
    p90 = med["ttft_p90_s"] / sim["ttft_p90_s"] - 1
    p50 = med["ttft_p50_s"] / sim["ttft_p50_s"] - 1
    spread_hit = (max(r["hit_rate"] for r in runs) - min(r["hit_rate"] for r in runs)) * 100
    spread_p90 = (max(r["ttft_p90_s"] for r in runs) - min(r["ttft_p90_s"] for r in runs)) / med["ttft_p90_s"]
    print(f"live - simulate: hit rate {hit_pts:+.2f} points (goal within 1; spread over live runs "
          f"{spread_hit:.2f}), TTFT p50 {p50:+.1%}, p90 {p90:+.1%} "
          f"(goal within 10 %; spread {spread_p90:.1%})")  # fmt: skip
    print("agree" if abs(hit_pts) <= 1 and abs(p90) <= 0.10 else "DISAGREE")
    if args.json:
        print(json.dumps({"simulate": sim, "live": runs, "live_median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
