"""Routing under sustained overload: kvgate's default policy against the cache-aware pick the peers make, in
``kvgate simulate``'s batching engines, when requests arrive faster than the engines serve them.

    python tests/bench/bench_overload.py [--loads 1,1.5,2,3] [--profiles llama3-8b-h100,llama3-70b-h100]
        [--window 600] [--conversation-stride 3] [--json]

Scenarios: every ``--window``-request window of the Mooncake synthetic trace, and every
``--conversation-stride``-th one of the conversation trace (``tests/data``), each replayed at load factor L:
arrivals L times as fast, the engines at their own speed (``perfmodel`` profile, 4 engines of 2,000 trace
blocks, KV pulls at 0.24 x prefill as in ``bench_true_time``). At L = 1 a window is the trace itself; where
arrivals outrun the engines, queues grow for the whole window, which is what an operator sees at a peak.

Policies: ``default`` (kvgate's), ``default, free moves`` (the same with ``session_slack_frac_per_waiting``
at 0: a session's move is not charged for the requests its recomputation delays), each ``--variant
NAME:KEY=VALUE,...`` (the default policy with those routing settings, e.g. ``frac4:session_slack_frac=4``) and
kvgate's ``cache_aware`` (the same time-to-first-token estimate, without sessions or pulls). The Rust
routers' rule differs (the best prefix match whatever the queues, unless the engines' request counts drift
far apart): ``bench_true_time`` runs them live.
Each row is the mean over a scenario's windows; ``vs cache_aware`` is the default policy's TTFT p90 over
cache_aware's, per window, as a geometric mean (below 1: faster).

The simulation is deterministic: reruns give the same figures, and its spread is between windows, which the
min-max of the hit-rate difference shows.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agreement import WORKLOADS, rebased
from bench_routers import PULL_FRACTION

from gateway.routing.base import RoutingSettings
from gateway.simulate import run_simulation
from perfmodel.profiles import profile
from region_map.simulation.simulator import CostModel
from region_map.simulation.trace import TraceRequest, load_trace

TRACES = {name: WORKLOADS[name] for name in ("synthetic", "conversation")}
ENGINES = 4
CAPACITY = 2000  # trace blocks per engine, as bench_true_time's 64,000 16-token blocks


def windows(trace: list[TraceRequest], size: int, stride: int, load: float) -> list[list[TraceRequest]]:
    """Every ``stride``-th window of ``size`` requests, its clock starting at 0 and its arrivals ``load``
    times as fast."""
    out = []
    for start in range(0, len(trace) - size + 1, size * stride):
        out.append(rebased(trace[start : start + size], load))
    return out


def replay(
    window: list[TraceRequest], profile_name: str, policy: str, overrides: dict[str, str]
) -> dict[str, float]:
    prof = profile(profile_name)
    pull_s = prof.prefill_s_per_token * PULL_FRACTION
    settings = RoutingSettings.model_validate(
        {
            "prefill_s_per_token": prof.prefill_s_per_token,
            "kv_pull": True,
            "kv_pull_s_per_token": pull_s,
            **overrides,
        }
    )
    result = run_simulation(
        window,
        policy=policy,
        regions=1,
        engines_per_region=ENGINES,
        capacity_blocks=CAPACITY,
        cost=CostModel(kv_pull_tokens_per_s=1.0 / pull_s),
        settings=settings,
        profile=prof,
    )
    return {
        "hit_rate": result.hit_rate,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p90_s": result.ttft_p90_s,
        "ttft_p99_s": result.ttft_p99_s,
    }


Variant = tuple[str, dict[str, str]]  # (policy, [gateway.routing] settings over the defaults)
VARIANTS: dict[str, Variant] = {
    "default": ("default", {}),
    "default, free moves": ("default", {"session_slack_frac_per_waiting": "0"}),
    "cache_aware": ("cache_aware", {}),
}


def parse_variant(text: str) -> tuple[str, Variant]:
    """``NAME:KEY=VALUE,...``: the default policy with those routing settings, shown as NAME."""
    name, _, spec = text.partition(":")
    pairs = [item.partition("=") for item in spec.split(",") if item]
    if not name or any(not key or not sep for key, sep, _ in pairs):
        raise argparse.ArgumentTypeError(f"expected NAME:KEY=VALUE,..., got {text!r}")
    return name, ("default", {key: value for key, _, value in pairs})


def scenario(
    trace: list[TraceRequest],
    profile_name: str,
    load: float,
    size: int,
    stride: int,
    variants: dict[str, Variant],
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for window in windows(trace, size, stride, load):
        for name, (policy, overrides) in variants.items():
            runs[name].append(replay(window, profile_name, policy, overrides))
    out: dict[str, Any] = {
        name: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    pairs = list(zip(runs["default"], runs["cache_aware"], strict=True))
    hit_gap = [d["hit_rate"] - c["hit_rate"] for d, c in pairs]
    ratios = [d["ttft_p90_s"] / c["ttft_p90_s"] for d, c in pairs]
    out["windows"] = len(hit_gap)
    out["hit_gap_min_max"] = (min(hit_gap), max(hit_gap))
    out["p90_vs_cache_aware"] = math.exp(statistics.mean(math.log(r) for r in ratios))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loads", default="1,1.5,2,3", help="comma-separated load factors")
    parser.add_argument("--profiles", default="llama3-8b-h100,llama3-70b-h100")
    parser.add_argument("--window", type=int, default=600, help="requests per window")
    parser.add_argument("--conversation-stride", type=int, default=3, help="every Nth conversation window")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="also the default policy with these [gateway.routing] settings (repeatable)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variants = VARIANTS | dict(args.variant)
    traces = {name: load_trace(path) for name, path in TRACES.items()}
    results: dict[str, Any] = {}
    for profile_name in args.profiles.split(","):
        for name, trace in traces.items():
            for load in (float(x) for x in args.loads.split(",")):
                key = f"{name} {profile_name} x{load:g}"
                stride = args.conversation_stride if name == "conversation" else 1
                results[key] = r = scenario(trace, profile_name, load, args.window, stride, variants)
                print(f"{key} ({r['windows']} windows)", file=sys.stderr)
                for policy in variants:
                    f = r[policy]
                    print(
                        f"  {policy:18s} hit {f['hit_rate']:6.2%}  TTFT p50 {f['ttft_p50_s']:6.2f} s"
                        f"  p90 {f['ttft_p90_s']:6.2f} s  p99 {f['ttft_p99_s']:6.2f} s",
                        file=sys.stderr,
                    )
                lo, hi = r["hit_gap_min_max"]
                print(
                    f"  default - cache_aware hit per window {lo:+.2%}..{hi:+.2%};"
                    f" default p90 / cache_aware p90 (geomean) {r['p90_vs_cache_aware']:.2f}",
                    file=sys.stderr,
                )
    print("over all scenarios: mean hit rate; TTFT p50/p90/p99 as geometric means of the ratio to default's",
          file=sys.stderr)  # fmt: skip
    for policy in variants:
        hit = statistics.mean(r[policy]["hit_rate"] for r in results.values())
        ratios = [
            math.exp(statistics.mean(math.log(r[policy][k] / r["default"][k]) for r in results.values()))
            for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
        ]
        print(f"  {policy:18s} hit {hit:6.2%}  TTFT " + "/".join(f"{x:.3f}" for x in ratios), file=sys.stderr)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
