"""kvgate and the Rust routers in front of engines that batch and queue like GPUs, at the traces' own time
scale (issue 24).

    python tests/bench/bench_true_time.py [--workloads conversation,synthetic] [--requests 300]
        [--profile llama3-8b-h100] [--runs 3] [--max-output 64] [--peers-venv DIR] [--smg-venv DIR] [--json]
        [--start N] [--load L] [--baseline-checkout DIR]

Engines: 4 simulated engines per router and run (``python -m engine.sim --profile NAME``: perfmodel's batching
step loop in real time, FIFO admission under the profile's token budget and KV capacity, chunked prefill, one
streamed token per decode step, prefix caches of 64,000 16-token blocks), fresh for every router and run so
that every router starts from empty caches. The engines report a local byte-level tokenizer (one token per
byte), so no router downloads anything.

Workloads (``tests/data/README.md``): the first ``--requests`` requests (from the ``--start``-th on, its
arrival becoming time 0; with ``--load L`` arriving L times as fast, a heavier load on engines that keep
their speed, not a faster clock) of

* ``conversation``: the Mooncake conversation trace (one hour of Kimi chat; every prompt starts with the same
  system block; 12k tokens in, 343 out on average);
* ``synthetic``: the Mooncake synthetic trace (built from public datasets: long documents and multi-turn
  chats, no prefix shared by all, 15k tokens in, 149 out; Poisson arrivals, turns in order),

each at its own clock: a request is sent at its arrival time (no compression), and nothing else is scaled,
so the gateway's own CPU time weighs what it would in production. Prompts: every hash id becomes the same 512
bytes (= 512 tokens), as in ``bench_routers``; outputs capped at ``--max-output`` tokens (0: the trace's).
Every request carries ``x-session-affinity`` = its conversation key (kvgate uses it, the peers ignore it).

Routers: kvgate (default policy, its prefill estimate set to the profile's, KV pulls between engines on at
0.24 x prefill, as the engines do them), smg, sglang-router and vllm-router (``--policy cache_aware``, as
``bench_routers`` starts them; a missing one is skipped with a line); with ``--baseline-checkout DIR``, also
``kvgate@base``, the kvgate of that checkout (before and after a change, in the same runs). Each run replays
each workload once per router, the routers in a new random order each run (interleaved: A B C D, C A D B,
...), so that drifts of this machine fall on all alike. The table gives each figure's median over runs and
its spread (max - min).

Hit rate: the engines' ``cached_tokens`` over prompt tokens. Above each table: the ceiling, what one engine
with an unbounded cache would find; and what the engines' caches would find pooled as one LRU cache, the
mark of their evictions, whoever routes (``trace_workload.lru_hit_rate``). TTFT: time to the first
streamed byte. Load: max/mean over the engines of the requests each finished, and of the time each spent in
steps (its busy seconds: the work it was given, which is what makes a queue; prompts differ tenfold in
length, so equal counts are not equal work). Below each table, per run and peer: the requests whose cached
tokens differ from kvgate's for the same request in the same run (on the synthetic trace, whose only
repeats are the 6 % of requests that are later turns, a hit-rate gap is a handful of long prompts, evicted
on one side only), with kvgate's route reasons on the requests the peer found more of (its
``x-kvgate-route``, and whether it had predicted as much). Last, how far each router's placements repeat:
the share of requests it sent to the same engine in two runs (each engine records the prompts it was sent,
``GET /debug/served``; the engines keep their ports from run to run, so a router that hashes their
addresses sees the same fleet every time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agreement import LIVE_BLOCK, WORKLOADS, body, max_over_mean, replay, start_engines, workload
from bench_routers import (
    PULL_FRACTION,  # start_kvgate's kv_pull_s_per_token ratio; the engines are told the same
    Router,
    byte_tokenizer_dir,
    peer_commands,
    start_kvgate,
    start_peer,
    wait_ready,
)
from trace_workload import (
    engine_counts,
    hit_ceiling,
    lru_hit_rate,
    placements,
    same_placements,
    scrape,
    served_prompts,
)

from cache.tokens import load_tokenizer
from engine.sim.server import prompt_key
from gateway.demo import EngineProcess, free_port, stop_engines, wait_healthy
from gateway.http.loop import install_best_loop, raise_open_file_limit
from perfmodel.profiles import EngineProfile, profile
from region_map.simulation.trace import TraceRequest

ENGINES = 4
CAPACITY_BLOCKS = 64_000  # 16-token blocks per engine: 2000 of the trace's 512-token blocks
FIGURES = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "load_max_over_mean", "busy_max_over_mean")
BUSY = "kvgate_engine_busy_seconds_total"  # the engine's step time, prefill and decode


async def engine_busy(engines: list[EngineProcess]) -> list[float]:
    return [(await scrape(e.port, BUSY))[0] for e in engines]


async def one(
    name: str,
    command: list[str] | Path | None,
    trace: list[TraceRequest],
    prompt_keys: list[int],
    ports: list[int],
    prof_name: str,
    prof: EngineProfile,
    tmp: Path,
) -> dict[str, Any]:
    """``name`` in front of fresh engines, ``trace`` replayed at its own time scale. ``command`` starts a
    peer; None starts this kvgate, a path the kvgate of that checkout. The engines listen on ``ports``.
    ``engine``: where each request went
    (the engines' record of the prompts they were sent: ``prompt_keys``, the trace's in order)."""
    tok = tmp / "tokenizer"
    engines = start_engines(
        ENGINES, tok, prof_name, "", CAPACITY_BLOCKS, prof.prefill_s_per_token * PULL_FRACTION, ports
    )
    router: Router | None = None
    try:
        await wait_healthy(engines)
        if command is None or isinstance(command, Path):
            router = start_kvgate(engines, tok, tmp, prof.prefill_s_per_token, checkout=command)
        else:
            router = start_peer(name, command, engines)
        if not await wait_ready(router):
            raise RuntimeError(f"{name} did not become ready")
        before, busy_before = await engine_counts(engines), await engine_busy(engines)
        figures = await replay(router.port, trace)
        figures["load_max_over_mean"] = max_over_mean(before, await engine_counts(engines))
        figures["busy_max_over_mean"] = max_over_mean(busy_before, await engine_busy(engines))
        figures["engine"] = placements(prompt_keys, [await served_prompts(e.port) for e in engines])
        return figures
    finally:
        if router is not None:
            router.process.terminate()
            router.process.wait(10)
        stop_engines(engines)


def hit_differences(workload_name: str, runs: dict[str, list[dict[str, Any]]], prompt_tokens: int) -> None:
    """Which requests make the hit-rate gap between kvgate and each peer: per run both replayed, the
    requests where the peer's engines reported more cached tokens than kvgate's did for the same request,
    and those with fewer. A gap of a few long prompts in one run says little; one that leans the same way
    run after run says more."""
    if "kvgate" not in runs:
        return
    ours_by_run = {r["run"]: r for r in runs["kvgate"]}
    print(f"\n{workload_name}: requests whose cached tokens differ from kvgate's in the same run "
          f"(peer more | peer fewer: requests, hit-rate points)")  # fmt: skip
    for name, peer_runs in runs.items():
        if name == "kvgate":
            continue
        cells, lost = [], []
        for theirs in peer_runs:
            ours = ours_by_run.get(theirs["run"])
            if ours is None:
                continue
            both = zip(ours["cached"], theirs["cached"], strict=True)
            pairs = [(a, b) for a, b in both if a >= 0 and b >= 0]
            more = [b - a for a, b in pairs if b > a]
            fewer = [a - b for a, b in pairs if a > b]
            cells.append(f"{len(more)}, {sum(more) / prompt_tokens * 100:+.2f}pt | {len(fewer)}, "
                         f"{-sum(fewer) / prompt_tokens * 100:+.2f}pt")  # fmt: skip
            lost.append(kvgate_side(ours, theirs))
        print(f"{name:14s} " + "; ".join(cells))
        print(f"{'':14s} where the peer found more, kvgate's route: " + "; ".join(lost))


def kvgate_side(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """kvgate's decisions on the requests where a peer's engines found more cached tokens: the reason it
    routed them by, and whether it expected as much as the peer found (then its engine had evicted what its
    view still held) or less (it chose an engine known to hold less, or knew of no engine holding it)."""
    reasons: dict[str, int] = {}
    expected = knowingly = 0
    for i, (a, b) in enumerate(zip(ours["cached"], theirs["cached"], strict=True)):
        if a < 0 or b <= a:
            continue
        reasons[ours["route"][i] or "?"] = reasons.get(ours["route"][i] or "?", 0) + 1
        if ours["predicted"][i] >= b:
            expected += 1
        else:
            knowingly += 1
    said = ", ".join(f"{r} {n}" for r, n in sorted(reasons.items()))
    return f"{said or 'none'} (expected as much: {expected}, less: {knowingly})"


def placement_repeats(workload_name: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    """How far each router's placements repeat from run to run: for every two runs, the share of requests
    it sent to the same engine both times. A router that reads only prefixes and its own view of the caches
    repeats itself; one that reads live queues follows their milliseconds."""
    print(f"\n{workload_name}: requests each router sent to the same engine in two runs "
          f"(median [min-max] over pairs of runs)")  # fmt: skip
    for name, router_runs in runs.items():
        shares = [
            same_placements(a["engine"], b["engine"])
            for i, a in enumerate(router_runs)
            for b in router_runs[i + 1 :]
        ]
        if shares:
            print(f"{name:14s} {statistics.median(shares):6.1%} [{min(shares):.1%}-{max(shares):.1%}]")


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs), "errors": sum(r["errors"] for r in runs)}
    for key in FIGURES:
        values = [r[key] for r in runs]
        out[key] = statistics.median(values)
        out[f"{key}_spread"] = max(values) - min(values)
    return out


def print_table(
    workload_name: str, trace: list[TraceRequest], args: argparse.Namespace, table: dict[str, Any]
) -> None:
    span = trace[-1].arrival_s - trace[0].arrival_s
    first = (
        f"{len(trace)} requests from request {args.start}" if args.start else f"first {len(trace)} requests"
    )
    if args.load != 1.0:
        first += f" arriving {args.load:g}x as fast"
    print(f"\n{workload_name}: {first} over {span:.0f} s at their own time scale, outputs"
          f" capped at {args.max_output or 'the trace'}; {ENGINES} engines under {args.profile}; medians of "
          f"{args.runs} interleaved runs, spread (max - min) after ±")  # fmt: skip
    ceiling = hit_ceiling(trace, LIVE_BLOCK)
    pooled = lru_hit_rate(trace, LIVE_BLOCK, ENGINES * CAPACITY_BLOCKS)
    print(f"hit ceiling (one engine, unbounded cache, {LIVE_BLOCK}-token blocks): {ceiling:.2%}; the"
          f" {ENGINES} engines' caches pooled as one LRU cache ({ENGINES} x {CAPACITY_BLOCKS:,} blocks):"
          f" {pooled:.2%}, the mark of their evictions")  # fmt: skip
    cols = ("hit rate", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "requests max/mean", "busy max/mean")
    print(f"{'router':14s} " + " ".join(f"{c:>17s}" for c in cols))
    for name, s in table.items():
        hit = f"{s['hit_rate']:7.2%} ±{s['hit_rate_spread'] * 100:5.2f}pt"
        ttft = " ".join(
            f"{s[k] * 1e3:8.1f} ±{s[k + '_spread'] * 1e3:6.1f}"
            for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
        )
        load = " ".join(
            f"{s[k]:10.2f} ±{s[k + '_spread']:5.2f}" for k in ("load_max_over_mean", "busy_max_over_mean")
        )
        errors = f"; {s['errors']} errors" if s["errors"] else ""
        print(f"{name:14s} {hit:>17s} {ttft} {load}{errors}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    peers = {n: c for n, c in peer_commands(args.peers_venv, args.smg_venv).items() if n in args.routers}
    routers: dict[str, list[str] | Path | None] = {"kvgate": None} if "kvgate" in args.routers else {}
    if args.baseline_checkout is not None:
        routers["kvgate@base"] = args.baseline_checkout
    routers |= peers
    prof = profile(args.profile)
    traces = {
        w: workload(args.requests, args.max_output or None, WORKLOADS[w], args.start, args.load)
        for w in args.workloads
    }
    results: dict[str, dict[str, list[dict[str, Any]]]] = {w: {n: [] for n in routers} for w in traces}
    shuffle = random.Random(args.seed).shuffle
    # The same ports in every run: a router that hashes its engines' addresses sees the same fleet each time.
    ports: list[int] = []
    while len(ports) < ENGINES:
        if (port := free_port()) not in ports:
            ports.append(port)
    with tempfile.TemporaryDirectory() as tmp:
        byte_tokenizer_dir(Path(tmp) / "tokenizer")
        tokenizer = load_tokenizer(Path(tmp) / "tokenizer")  # (the engines' own: their keys of the prompts)
        keys = {
            w: [prompt_key(tokenizer.encode(orjson.loads(body(r))["prompt"])) for r in trace]
            for w, trace in traces.items()
        }
        for run_index in range(args.runs):
            for w, trace in traces.items():
                order = list(routers)
                shuffle(order)
                for name in order:
                    print(f"run {run_index + 1}/{args.runs}, {w}: {name}", file=sys.stderr, flush=True)
                    try:
                        figures = await one(
                            name, routers[name], trace, keys[w], ports, args.profile, prof, Path(tmp)
                        )
                    except RuntimeError as exc:
                        print(f"{name}: {exc}; skipped in this run", file=sys.stderr)
                        continue
                    figures["run"] = run_index  # (hit_differences pairs runs by it: a run may be skipped)
                    results[w][name].append(figures)
    return {
        "tables": {
            w: {n: summary(rs) for n, rs in by_router.items() if rs} for w, by_router in results.items()
        },
        "runs": results,
        "traces": traces,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", default="conversation,synthetic")
    parser.add_argument("--requests", type=int, default=300, help="the first N requests of each trace")
    parser.add_argument(
        "--start", type=int, default=0, help="replay from this request on (its arrival becomes time 0)"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=1.0,
        help="arrivals this many times as fast (the engines and the routers keep their own speed)",
    )
    parser.add_argument(
        "--baseline-checkout",
        type=Path,
        default=None,
        help="also run the kvgate of this checkout (git worktree add DIR COMMIT) as kvgate@base",
    )
    parser.add_argument("--profile", default="llama3-8b-h100")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs (medians and spread over them)")
    parser.add_argument("--max-output", type=int, default=64, help="cap on output tokens (0: the trace's)")
    parser.add_argument("--routers", default="kvgate,smg,sglang-router,vllm-router")
    parser.add_argument("--peers-venv", type=Path, default=os.environ.get("KVGATE_PEERS_VENV"))
    parser.add_argument("--smg-venv", type=Path, default=os.environ.get("KVGATE_SMG_VENV"))
    parser.add_argument("--seed", type=int, default=0, help="of the routers' order in each run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(sorted(unknown))}; known: {', '.join(WORKLOADS)}")
    args.routers = set(args.routers.split(","))
    profile(args.profile)  # a wrong name fails now, not after the first engines start
    install_best_loop()
    raise_open_file_limit()
    out = asyncio.run(run(args))
    print(f"\nblocks of {LIVE_BLOCK} tokens; KV pulls (kvgate only: the peers have no pull protocol) at "
          f"{PULL_FRACTION} x the profile's prefill cost per token")  # fmt: skip
    for w, table in out["tables"].items():
        print_table(w, out["traces"][w], args, table)
        prompt_tokens = sum(r.input_tokens for r in out["traces"][w])
        hit_differences(w, out["runs"][w], prompt_tokens)
        placement_repeats(w, out["runs"][w])
    if args.json:
        print(json.dumps({"tables": out["tables"], "runs": out["runs"]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
