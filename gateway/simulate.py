"""``kvgate simulate``: replay a Mooncake trace through the gateway's real routing, on simulated regions.

The engines, their caches and their clock are region_map's discrete-event model; every decision is made by
the very policy objects the gateway runs (``gateway.routing``), fed the way the gateway feeds them: a
residency view kept up to date by the engines' (simulated) KV events, session bindings for the key a client
would send (see ``region_map.trace``), per-candidate load, and the round trip from the client's home
region. Cross-region traffic is capped by the same limiter the gateway uses.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cache.residency_memory import MemoryResidencyIndex
from cache.sessions import MemorySessionStore, SessionBinding
from gateway.routing import POLICIES, Candidate, RouteRequest, RoutingPolicy
from gateway.routing.base import RoutingSettings, route_key, with_peers
from gateway.routing.regional import RemoteShareLimiter
from region_map.simulator import CostModel, SimEngine, SimResult, simulate
from region_map.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

POLICY_ALIASES = {"prefix": "cache_aware"}
SESSION_POLICIES = frozenset({"session", "default"})  # policies that read x-session-affinity
TENANT = "trace"


class SimRouter:
    """What the gateway does for one request, minus HTTP: lookup, candidates, policy, bindings."""

    def __init__(
        self,
        policy: RoutingPolicy,
        *,
        rtt_s: float,
        uses_sessions: bool,
        limiter: RemoteShareLimiter | None = None,
        block_tokens: int = TRACE_BLOCK_TOKENS,
    ) -> None:
        self.policy = policy
        self.index = MemoryResidencyIndex(clock=lambda: 0.0)  # exact entries only: no TTLs in the replay
        self.sessions = MemorySessionStore(ttl_s=float("inf"))
        self.uses_sessions = uses_sessions
        self.limiter = limiter
        self.rtt_s = rtt_s
        self.block_tokens = block_tokens
        self.seq = 0

    def kv_changed(self, engine_id: str, stored: list[int], evicted: list[int]) -> None:
        if stored:
            self.index.add_now(engine_id, stored)
        if evicted:
            self.index.remove_now(engine_id, evicted)

    def route(
        self, request: TraceRequest, home: str, now: float, engines: Sequence[SimEngine]
    ) -> tuple[SimEngine, SimEngine | None]:
        self.seq += 1
        cached = self.index.lookup(request.blocks)
        session_id = str(request.conversation) if self.uses_sessions else None
        binding = self.sessions.get_now(TENANT, session_id) if session_id else None
        candidates = [
            Candidate(
                engine=e.id,
                region=e.region,
                healthy=True,
                load=e.in_flight(now),
                waiting=e.waiting(now),
                cached_tokens=cached.get(e.id, 0) * self.block_tokens,
                rtt_s=0.0 if e.region == home else self.rtt_s,
                queued_prefill_tokens=e.queued_prefill_tokens(now),
            )
            for e in engines
        ]
        if self.policy.pulls_kv:
            candidates = with_peers(candidates)
        usable = self.limiter.eligible(home, candidates) if self.limiter else candidates
        decision = self.policy.pick(
            RouteRequest(
                prompt_tokens=request.input_tokens,
                route_key=route_key(TENANT, session_id, request.blocks),
                seq=self.seq,
                session_engine=binding.engine if binding else None,
            ),
            usable,
        )
        if decision is None:
            raise RuntimeError("the policy found no engine (every simulated engine is healthy)")
        engine = next(e for e in engines if e.id == decision.engine)
        if session_id is not None and (binding is None or binding.engine != engine.id):
            self.sessions.bind_now(TENANT, session_id, SessionBinding(engine.region, engine.id))
        if self.limiter is not None:
            self.limiter.record(home, engine.region)
        return engine, next((e for e in engines if e.id == decision.kv_source), None)


def run_simulation(
    trace: Sequence[TraceRequest],
    *,
    policy: str,
    regions: int,
    engines_per_region: int,
    capacity_blocks: int,
    cost: CostModel | None = None,
    max_remote_share: float = 0.2,
    settings: RoutingSettings | None = None,
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    cost = cost or CostModel()
    name = POLICY_ALIASES.get(policy, policy)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join([*POLICIES, *POLICY_ALIASES])})")
    # The estimate's prefill cost is the simulated engines' own, as an operator would configure it.
    pulls = cost.kv_pull_tokens_per_s > 0
    settings = settings or RoutingSettings(
        prefill_s_per_token=1.0 / cost.prefill_tokens_per_s,
        kv_pull=pulls,
        kv_pull_s_per_token=1.0 / cost.kv_pull_tokens_per_s if pulls else 0.0,
    )
    router = SimRouter(
        POLICIES[name](settings),
        rtt_s=cost.rtt_s,
        uses_sessions=name in SESSION_POLICIES,
        limiter=RemoteShareLimiter(max_remote_share) if regions > 1 else None,
        block_tokens=cost.block_tokens,
    )
    names = [f"region-{i}" for i in range(regions)]
    return simulate(
        trace,
        regions=names,
        engines_per_region=engines_per_region,
        capacity_blocks=capacity_blocks,
        router=router,
        cost=cost,
        progress=progress,
    )


def main(args: Any) -> int:
    from tqdm import tqdm

    trace = load_trace(Path(args.trace), limit=args.limit)
    cost = CostModel(
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_s_per_token=args.decode_s_per_token,
        rtt_s=args.rtt_ms / 1000,
        kv_pull_tokens_per_s=args.kv_pull_tokens_per_s,
    )
    with tqdm(
        total=len(trace), unit="req", file=sys.stderr, disable=None, desc=f"simulate {args.policy}"
    ) as bar:
        done = [0]

        def advance(n: int) -> None:
            bar.update(n - done[0])
            done[0] = n

        result = run_simulation(
            trace,
            policy=args.policy,
            regions=args.regions,
            engines_per_region=args.engines_per_region,
            capacity_blocks=args.capacity_blocks,
            cost=cost,
            max_remote_share=args.max_remote_share,
            progress=advance,
        )
        advance(len(trace))
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        r = result
        print(f"{args.policy}: {r.requests} requests on {args.regions} x {args.engines_per_region} engines")
        print(
            f"  hit rate {r.hit_rate:.1%} (oracle {r.oracle_hit_rate:.1%}, "
            f"pooled LRU {r.pooled_hit_rate:.1%})"
        )
        print(f"  TTFT p50 {r.ttft_p50_s:.3f} s, p90 {r.ttft_p90_s:.3f} s, p99 {r.ttft_p99_s:.3f} s")
        print(f"  load max/mean {r.load_max_over_mean:.2f}, cross-region share {r.cross_region_share:.1%}")
    return 0
