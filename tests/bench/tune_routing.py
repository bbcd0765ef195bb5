"""Re-tune the routing constants on the batching cost model: one constant at a time around the defaults,
every variant replayed by ``kvgate simulate``'s engine (``gateway.simulate.run_simulation`` with a
``perfmodel`` profile) on both workloads and both profiles (issue 24).

    python tests/bench/tune_routing.py [--requests 1500] [--engines 4] [--capacity 2000] [--only KNOB,...]
        [--profiles llama3-8b-h100,llama3-70b-h100] [--max-output 0] [--json]

Workloads: the Mooncake conversation trace and the Mooncake synthetic trace (``tests/data``), their first
``--requests`` requests each at their own time scale. Profiles: ``llama3-8b-h100`` and ``llama3-70b-h100``
(TP4). KV pulls cost 0.24 x prefill per token, as in ``bench_true_time``. For each variant the table gives,
per scenario, hit rate, TTFT p50/p90/p99 and requests max/mean per engine, and the geometric mean over
scenarios of each TTFT percentile as a ratio to the defaults' (below 1: better). The constants are in
prefill tokens (they scale with the engine's speed), so one setting is sought that suits every profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

from engine.sim.config import SimEngineConfig
from gateway.routing.base import RoutingSettings
from gateway.simulate import run_simulation
from perfmodel.profiles import profile
from region_map.simulation.simulator import CostModel
from region_map.simulation.trace import load_trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agreement import WORKLOADS
from bench_routers import PULL_FRACTION

PROFILES = ("llama3-8b-h100", "llama3-70b-h100")

# One constant at a time; the first value of each is the current default.
SWEEP: dict[str, list[float]] = {
    "session_slack_tokens": [1000, 0, 250, 4000, 16000],
    "session_slack_frac": [1.0, 0.5, 2.0, 4.0],
    "session_slack_frac_per_waiting": [1.0, 0.0, 0.5, 2.0, 4.0],
    "load_penalty_tokens": [40, 0, 200, 500, 1000, 2000, 4000, 16000],
    "tie_tolerance_frac": [0.05, 0.0, 0.02, 0.08, 0.1, 0.12, 0.15, 0.2],
    "tie_tolerance_tokens": [20, 0, 200, 1000],
}


def scenario_settings(prefill_s: float, **overrides: float) -> RoutingSettings:
    pull_s = prefill_s * PULL_FRACTION
    # Validated as a configuration is (model_validate): the knobs under sweep come by name.
    return RoutingSettings.model_validate(
        {"prefill_s_per_token": prefill_s, "kv_pull": True, "kv_pull_s_per_token": pull_s, **overrides}
    )


def run_one(trace: Any, prof_name: str, engines: int, capacity: int, **overrides: float) -> dict[str, float]:
    prof = profile(prof_name)
    pull_s = prof.prefill_s_per_token * PULL_FRACTION
    cost = CostModel(kv_pull_tokens_per_s=1.0 / pull_s)
    result = run_simulation(trace, policy="default", regions=1, engines_per_region=engines,
                            capacity_blocks=capacity, cost=cost, profile=prof,
                            settings=scenario_settings(prof.prefill_s_per_token, **overrides))  # fmt: skip
    return result.as_json()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=2000, help="prefix cache per engine, trace blocks")
    parser.add_argument("--only", default="", help="comma-separated constants to sweep (default: all)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="comma-separated engine profiles")
    parser.add_argument("--max-output", type=int, default=0, help="cap on output tokens (0: the trace's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # As the live benches do: leave out a request longer than the engines' context (the synthetic trace's
    # 134,773-token prompt), which every engine refuses.
    context = SimEngineConfig("tune").max_model_len
    traces = {
        name: [
            r for r in load_trace(path, limit=args.requests) if r.input_tokens + r.output_tokens <= context
        ]
        for name, path in WORKLOADS.items()
    }
    if args.max_output:  # as the live benches cap outputs (bench_true_time's --max-output)
        traces = {
            name: [
                dataclasses.replace(r, output_tokens=max(1, min(r.output_tokens, args.max_output))) for r in t
            ]
            for name, t in traces.items()
        }
    profiles = [p for p in args.profiles.split(",") if p]
    scenarios = [(w, p) for w in traces for p in profiles]
    sweep = {k: v for k, v in SWEEP.items() if not args.only or k in args.only.split(",")}
    baseline = {s: run_one(traces[s[0]], s[1], args.engines, args.capacity) for s in scenarios}
    rows: list[dict[str, Any]] = []
    head = " ".join(f"{w[:4]}/{p.split('-')[1]:>4s} hit  p50   p90   p99  load" for w, p in scenarios)
    print(f"{'variant':28s} {head} | geomean p50 p90 p99 (x default)")
    for knob, values in sweep.items():
        for value in values:
            figures = (
                baseline
                if value == values[0]
                else {
                    s: run_one(traces[s[0]], s[1], args.engines, args.capacity, **{knob: value})
                    for s in scenarios
                }
            )
            ratios = {
                q: math.exp(
                    sum(math.log(figures[s][f"ttft_{q}_s"] / baseline[s][f"ttft_{q}_s"]) for s in scenarios)
                    / len(scenarios)
                )
                for q in ("p50", "p90", "p99")
            }
            cells = " ".join(
                f"{figures[s]['hit_rate']:5.1%} "
                + " ".join(f"{figures[s][f'ttft_{q}_s']:5.2f}" for q in ("p50", "p90", "p99"))
                + f" {figures[s]['load_max_over_mean']:5.2f}"
                for s in scenarios
            )
            label = f"{knob}={value:g}" + (" (default)" if value == values[0] else "")
            print(
                f"{label:28s} {cells} | {ratios['p50']:.3f} {ratios['p90']:.3f} {ratios['p99']:.3f}",
                flush=True,
            )
            rows.append({"knob": knob, "value": value, "ratios": ratios,
                         "figures": {f"{w}/{p}": figures[(w, p)] for w, p in scenarios}})  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
