"""Routing policies on the Mooncake conversation trace, replayed through the gateway's real policy objects
on simulated regions (``kvgate simulate``), against the pooled LRU of the same total capacity.

    python tests/bench/bench_regions.py [--trace FILE] [--limit N] [--json] [--spread N]

Configurations: 1 region x 8 engines x 2,000 blocks and 4 regions x 2 engines x 2,000 blocks (40 ms between
regions). Policies: round_robin, session only, prefix only (cache_aware), and default. The target: the
default policy reaches >= 98 % of the pooled LRU's hit rate with max/mean load <= 1.10 and the lowest TTFT
p90 of all policies. Engines can pull a prefix from a peer in their region
(``CostModel.kv_pull_tokens_per_s``); only the default policy asks for pulls, and the row "default, no
pull" shows it without them (an ablation, left out of the verdict). "pulls": the requests told to pull.

The replay is chaotic: one routing decision changes every later cache state, so a 1 % change of capacity
moves a policy's p90 by about as much as the policies differ. ``--spread N`` repeats every run at N
capacities from 97.5 % to 102.5 % of ``--capacity-blocks`` and reports the means, which separates a
policy's real effect from the luck of one configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from gateway.simulate import run_simulation
from region_map.simulation.simulator import CostModel, LRUBlocks, percentile
from region_map.simulation.trace import TraceRequest, load_trace

DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"
CONFIGS = [(1, 8), (4, 2)]
POLICIES = [("round_robin", "round_robin"), ("session only", "session"), ("prefix only", "cache_aware"),
            ("default", "default")]  # fmt: skip
# What the pulls contribute: the default policy with engines that cannot pull (not part of the verdict).
ABLATIONS = [("default, no pull", "default")]


def pooled_floor_p90(trace: list[TraceRequest], capacity_blocks: int, cost: CostModel) -> float:
    """TTFT p90 if every request found the pooled LRU's hits and never queued: only its own uncached
    prefill. No routing of per-engine caches can do much better; it shows how much room there is."""
    pooled = LRUBlocks(capacity_blocks)
    ttfts = []
    for r in trace:
        hit = pooled.prefix(r.blocks)
        pooled.insert(r.blocks)
        ttfts.append(max(0, r.input_tokens - hit * cost.block_tokens) / cost.prefill_tokens_per_s)
    return percentile(ttfts, 0.90)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(DEFAULT_TRACE))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--capacity-blocks", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--spread", type=int, default=1, help="capacities to average over (default 1)")
    args = parser.parse_args()
    n = max(1, args.spread)
    steps = [0.975 + 0.05 * i / (n - 1) for i in range(n)] if n > 1 else [1.0]
    capacities = [round(args.capacity_blocks * step) for step in steps]
    trace = load_trace(args.trace, limit=args.limit)
    cost = CostModel(rtt_s=0.040)
    no_pull = CostModel(rtt_s=0.040, kv_pull_tokens_per_s=0.0)
    rows = []
    runs = [
        (regions, per_region, label, policy)
        for regions, per_region in CONFIGS
        for label, policy in POLICIES + ABLATIONS
    ]
    bar = tqdm(total=len(runs) * len(capacities), desc="simulations", file=sys.stderr)
    for regions, per_region, label, policy in runs:
        start = time.perf_counter()
        results = []
        for capacity in capacities:
            r = run_simulation(
                trace,
                policy=policy,
                regions=regions,
                engines_per_region=per_region,
                capacity_blocks=capacity,
                cost=cost if (label, policy) not in ABLATIONS else no_pull,
            )
            results.append(r.as_json())
            bar.update()
        mean = {key: sum(r[key] for r in results) / len(results) for key in results[0]}
        rows.append({"config": f"{regions}x{per_region}", "policy": label, **mean,
                     "seconds": time.perf_counter() - start})  # fmt: skip
    bar.close()
    blocks = f"{args.capacity_blocks}" if n == 1 else f"mean over {capacities}"
    print(f"{len(trace)} requests; {blocks} blocks per engine; hit = prompt blocks from cache")
    header = f"{'config':7s} {'policy':16s} {'hit':>7s} {'vs pooled':>9s} {'load':>6s} {'TTFT p50':>9s} " \
             f"{'p90':>8s} {'p99':>8s} {'cross':>6s} {'pulls':>6s}"  # fmt: skip
    print(header)
    for row in rows:
        share = row["hit_rate"] / row["pooled_hit_rate"]
        print(
            f"{row['config']:7s} {row['policy']:16s} {row['hit_rate']:7.1%} {share:9.1%} "
            f"{row['load_max_over_mean']:6.2f} {row['ttft_p50_s']:8.3f}s {row['ttft_p90_s']:7.3f}s "
            f"{row['ttft_p99_s']:7.3f}s {row['cross_region_share']:6.1%} {row['pull_share']:6.1%}"
        )
    for config in dict.fromkeys(row["config"] for row in rows):
        ablations = {label for label, _ in ABLATIONS}
        group = [r for r in rows if r["config"] == config and r["policy"] not in ablations]
        pooled, oracle = group[0]["pooled_hit_rate"], group[0]["oracle_hit_rate"]
        default = next(r for r in group if r["policy"] == "default")
        best_p90 = min(r["ttft_p90_s"] for r in group)
        verdict = (default["hit_rate"] >= 0.98 * pooled and default["load_max_over_mean"] <= 1.10
                   and default["ttft_p90_s"] <= best_p90)  # fmt: skip
        print(
            f"{config}: pooled LRU {pooled:.1%}, oracle {oracle:.1%}; default reaches "
            f"{default['hit_rate'] / pooled:.1%} of pooled, load {default['load_max_over_mean']:.2f}, "
            f"lowest p90: {default['ttft_p90_s'] <= best_p90} -> target {'met' if verdict else 'NOT met'}"
        )
    floor = pooled_floor_p90(trace, 8 * args.capacity_blocks, cost)
    print(f"for scale: TTFT p90 with the pooled LRU's hits and no queueing at all: {floor:.3f} s")
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
