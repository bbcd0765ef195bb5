"""``kvgate simulate``: replay a Mooncake trace through the gateway's own ``Router`` on simulated regions.

The engines, their caches and their clock are region_map's discrete-event model; every decision is made by
``gateway.routing.router.Router``, the object the gateway itself routes with, over a ``Fleet`` of engine
states that mirror the simulated engines (their load before each decision, their stored and evicted blocks
as KV events) and a ``SharedState`` without Redis, as an embedded gateway runs. Session bindings use the key
a client would send (see ``region_map.simulation.trace``), round trips are measured from the client's home
region, and cross-region traffic is capped by the Router's own limiter. Simulated time is the clock of the
view.

With ``--profile`` every simulated engine is instead ``perfmodel``'s batching cost model under that engine
profile (``region_map.simulation.batched``): continuous batching, chunked prefill, the step times the
simulated engine uses too; the router's estimate then takes the profile's prefill cost per token.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.config import GatewaySettings
from gateway.config_tables import ResilienceSettings
from gateway.http.errors import GatewayError
from gateway.routing import POLICIES, RoutingPolicy
from gateway.routing.base import RoutingSettings, route_key
from gateway.routing.route import Route
from gateway.routing.router import Router
from gateway.state.shared_state import SharedState
from gateway.user_errors import UserError
from region_map.config import EngineConfig, RegionConfig, TopologyConfig
from region_map.fleet import ChainKey, EngineLoad, Fleet
from region_map.simulation.simulator import CostModel, SimEngine, SimResult, simulate
from region_map.simulation.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_trace

if TYPE_CHECKING:  # perfmodel is imported only when a profile is asked for
    from perfmodel.profiles import EngineProfile
    from region_map.simulation.batched import StepHook

POLICY_ALIASES = {"prefix": "cache_aware"}
SESSION_POLICIES = frozenset({"session", "default"})  # policies that read x-session-affinity
TENANT = "trace"
MODEL = "trace-model"
UNLIMITED = 1 << 40  # admission limits: the simulated engines queue whatever they are sent


@dataclass(slots=True)
class TraceAsk:
    """A trace request as the Router reads a prepared one: its blocks are the hash ids of the trace."""

    session_id: str | None
    home_region: str
    chains: dict[ChainKey, list[int]]
    prompt_tokens: int
    route_key: int
    tenant: str = TENANT
    model: str = MODEL
    tools: bool = False
    pinned_engine: str | None = None
    disaggregable: bool = True


@dataclass
class SimRouter:
    """The gateway's Router in front of simulated engines: mirrors their load into the fleet before each
    decision and their stored/evicted blocks into the residency view, as health polls and KV events do."""

    router: Router
    fleet: Fleet
    uses_sessions: bool
    block_tokens: int = TRACE_BLOCK_TOKENS
    now: list[float] = field(default_factory=lambda: [0.0])  # the simulated clock the view reads
    routed: int = 0
    # Routes whose prefill is not done, by their number: their queued tokens and uncomputed blocks stay
    # in the engine's prefill queue until then, as a live gateway's stay until the first token.
    pending: dict[int, Route] = field(default_factory=dict)

    def kv_changed(self, engine_id: str, stored: list[int], evicted: list[int]) -> None:
        index = self.router.state.index
        if stored:
            index.add_now(engine_id, stored)
        if evicted:
            index.remove_now(engine_id, evicted)

    def first_token(self, n: int, at: float) -> None:
        route = self.pending.pop(n, None)
        if route is not None:
            clock = self.now[0]
            self.now[0] = at  # (the queue's drain restarts when the oldest prefill ends)
            route.settle()
            self.now[0] = clock

    def route(
        self, request: TraceRequest, home: str, now: float, engines: Sequence[SimEngine]
    ) -> tuple[SimEngine, SimEngine | None]:
        self.now[0] = now
        for sim in engines:
            state = self.fleet.engines[sim.id]
            running, waiting = sim.in_flight(now), sim.waiting(now)
            room = sim.room(now)
            max_running, free_tokens = room if room is not None else (None, None)
            state.load = EngineLoad(
                running=running - waiting,
                waiting=waiting,
                waiting_tokens=sim.queued_prefill_tokens(now),
                max_running=max_running,
                kv_blocks_free=None if free_tokens is None else free_tokens // self.block_tokens,
            )
        session_id = str(request.conversation) if self.uses_sessions else None
        ask = TraceAsk(
            session_id=session_id,
            home_region=home,
            chains={ChainKey(self.block_tokens, True): list(request.blocks)},
            prompt_tokens=request.input_tokens,
            route_key=route_key(TENANT, session_id, request.blocks),
        )
        route = self.router.decide(self.router.plan(ask))
        if isinstance(route, GatewayError):
            raise RuntimeError(f"the router found no engine: {route.message}")
        self.router.confirm(route, ask)
        self.routed += 1
        self.pending[self.routed] = route
        by_id = {e.id: e for e in engines}
        return by_id[route.engine.id], by_id.get(route.decision.kv_source or "")


def sim_router(
    policy: RoutingPolicy,
    settings: RoutingSettings,
    *,
    regions: Sequence[str],
    engines_per_region: int,
    rtt_s: float,
    uses_sessions: bool,
    block_tokens: int = TRACE_BLOCK_TOKENS,
) -> SimRouter:
    """A Router over a fleet shaped like the simulation's: every engine healthy, kvgate's kind, publishing
    KV events, pulling from its peers when the settings let the policy ask for pulls."""
    topology = TopologyConfig(
        region=regions[0],
        regions=[
            RegionConfig(
                name=region,
                engines=[
                    EngineConfig(
                        name=f"e{i}",
                        url=f"http://sim-{n}-{i}.invalid:1",  # type: ignore[arg-type]
                        model=MODEL,
                        block_size=block_tokens,
                        kv_events=True,
                        kv_pull=settings.kv_pull,
                    )
                    for i in range(engines_per_region)
                ],
            )
            for n, region in enumerate(regions)
        ],
        default_rtt_ms=rtt_s * 1000,
    )
    fleet = Fleet(topology)
    for engine in fleet:
        engine.healthy = True
    gateway = GatewaySettings(
        routing=settings,
        block_size=block_tokens,
        min_block_size=block_tokens,
        resilience=ResilienceSettings(max_inflight_per_engine=UNLIMITED, max_waiting_per_engine=UNLIMITED),
    )
    now = [0.0]
    state = SharedState(gateway_id="simulate", session_ttl_s=float("inf"), clock=lambda: now[0])
    router = Router(gateway, fleet, state, policy, wall_clock=lambda: now[0], monotonic=lambda: now[0])
    return SimRouter(router, fleet, uses_sessions, block_tokens, now)


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
    profile: EngineProfile | None = None,
    on_step: StepHook | None = None,
) -> SimResult:
    """Replay ``trace`` through ``policy``: engines are ``cost``'s FIFO prefill servers, or with ``profile``
    ``perfmodel``'s batching model under it (``on_step`` hears each of their steps)."""
    cost = cost or CostModel()
    name = POLICY_ALIASES.get(policy, policy)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (one of {', '.join([*POLICIES, *POLICY_ALIASES])})")
    # The estimate's prefill cost is the simulated engines' own, as an operator would configure it.
    pulls = cost.kv_pull_tokens_per_s > 0
    settings = settings or RoutingSettings(
        prefill_s_per_token=profile.prefill_s_per_token if profile else 1.0 / cost.prefill_tokens_per_s,
        kv_pull=pulls,
        kv_pull_s_per_token=1.0 / cost.kv_pull_tokens_per_s if pulls else 0.0,
    )
    settings = settings.model_copy(update={"max_remote_share": max_remote_share})
    names = [f"region-{i}" for i in range(regions)]
    router = sim_router(
        POLICIES[name](settings),
        settings,
        regions=names,
        engines_per_region=engines_per_region,
        rtt_s=cost.rtt_s,
        uses_sessions=name in SESSION_POLICIES,
        block_tokens=cost.block_tokens,
    )
    return simulate(
        trace,
        regions=names,
        engines_per_region=engines_per_region,
        capacity_blocks=capacity_blocks,
        router=router,
        cost=cost,
        progress=progress,
        profile=profile,
        on_step=on_step,
    )


def engine_profile(name: str | None, overrides: str | None) -> EngineProfile | None:
    """The profile ``--profile``/``--profile-overrides`` name (None: the FIFO model); a ``UserError``
    (status 2) in one line for an unknown profile, a bad override or overrides without a profile."""
    if name is None:
        if overrides:
            raise UserError("--profile-overrides needs --profile NAME", status=2)
        return None
    from perfmodel.profiles import parse_overrides, profile, with_overrides

    try:
        return with_overrides(profile(name), **parse_overrides(overrides or ""))
    except ValueError as exc:
        raise UserError(str(exc), status=2) from None


def main(args: Any) -> int:
    from tqdm import tqdm

    profile = engine_profile(args.profile, args.profile_overrides)
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
            profile=profile,
        )
        advance(len(trace))
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        r = result
        model = f" (engine profile {args.profile})" if profile else ""
        shape = f"{args.regions} x {args.engines_per_region} engines"
        print(f"{args.policy}: {r.requests} requests on {shape}{model}")
        print(
            f"  hit rate {r.hit_rate:.1%} (oracle {r.oracle_hit_rate:.1%}, "
            f"pooled LRU {r.pooled_hit_rate:.1%})"
        )
        print(f"  TTFT p50 {r.ttft_p50_s:.3f} s, p90 {r.ttft_p90_s:.3f} s, p99 {r.ttft_p99_s:.3f} s")
        print(f"  load max/mean {r.load_max_over_mean:.2f}, cross-region share {r.cross_region_share:.1%}")
    return 0
