"""Where the routing decision is made: one request, one engine, decided and committed in one place.

``Router.decide`` builds the candidates (health, circuit breaker, admission, cached prefixes, peers, the
remote-share cap), asks the policy, chooses the prefill engine when engines are disaggregated, and commits
the decision before it returns, with no await in between: the session is bound to the chosen engine, the
prompt's new blocks are noted as held soon there, and its uncached tokens as queued there. A parallel
request decided a microsecond later therefore sees the first one's choice: the twin requests of an agent's
fan-out, or the first requests of a new session sent at once, land together. ``confirm`` finishes the
commit once the engine took the request; ``release`` takes the claim back when it failed before that. The
first decision for a session this gateway's view does not hold is also a claim in Redis, where the first
claim wins: ``follow_claim`` waits for its answer and decides again if another gateway's came first.

The gateway (``gateway.service``) and ``kvgate simulate`` (``gateway.simulate``) both drive this class: the
simulator feeds it simulated engines' load and KV events, the gateway real ones. The request's routing
inputs (``Plan``) and the committed decision (``Route``) are in ``gateway.routing.route``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from cache.sessions import SessionBinding
from gateway.config import GatewaySettings
from gateway.http.errors import GatewayError, NoCapacity, Overloaded
from gateway.http.retry_after import retry_after_headers
from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingPolicy, with_peers
from gateway.routing.disaggregation import choose_prefill, prefills_elsewhere_only
from gateway.routing.regional import RemoteShareLimiter
from gateway.routing.route import Plan, Route, RoutingAsk, RoutingMetrics
from gateway.state.shared_state import SharedState
from region_map.config import EngineKind, Role
from region_map.fleet import EngineState, Fleet

# Blocks of a new prefix noted as "held soon" until the engine's events confirm them: a parallel request
# counts them as cached (64k tokens of 16-token blocks: a set update, ~15 us a thousand; longer prompts note
# their start).
PENDING_MAX_BLOCKS = 4096
# No engine can take a request now (none healthy, all at their limits): one may have room or be back by then.
NO_ENGINE_RETRY_AFTER_S = 1


class Router:
    def __init__(
        self,
        settings: GatewaySettings,
        fleet: Fleet,
        state: SharedState,
        policy: RoutingPolicy,
        *,
        metrics: RoutingMetrics | None = None,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.state = state
        self.policy = policy
        self.metrics = metrics
        self.limiter = RemoteShareLimiter(settings.routing.max_remote_share)
        self._wall_clock = wall_clock  # stamps session bindings: the newest binding wins across gateways
        self._monotonic = monotonic  # times the engines' prefill queues (PrefillQueue.estimate)
        self._seq = 0
        self._roles_memo: tuple[list[EngineState], list[EngineState], list[EngineState]] | None = None

    # -- inputs ----------------------------------------------------------------------------------------

    def find_session(self, ask: RoutingAsk) -> None:
        """Restart the TTL of the request's session binding (no I/O: a session this gateway's view does not
        hold is looked up in Redis by its claim, see ``follow_claim``)."""
        if ask.session_id is not None:
            self.state.touch_session(ask.tenant, ask.session_id)

    def plan(self, ask: RoutingAsk) -> Plan:
        """The request's engines and cached prefixes, computed once for all its attempts."""
        engines = self.fleet.serving(ask.model)
        if ask.tools:
            engines = [e for e in engines if e.config.tools]
        answering, prefilling = self._roles(engines)
        if ask.pinned_engine is not None:
            # It continues a response stored on that engine (the Responses API's previous_response_id):
            # no other engine knows it.
            answering = [e for e in answering if e.id == ask.pinned_engine]
        if not ask.disaggregable:
            prefilling = []
        cached, confirmed = self.cached_tokens(ask, engines)
        # What a peer could give, when a pull is possible at all: what its KV events confirmed.
        pulls = bool(cached) and self.policy.pulls_kv and any(e.kv_pull for e in engines)
        return Plan(
            ask, self._with_room(answering, ask.model), prefilling, cached, confirmed if pulls else None
        )

    def _roles(self, engines: list[EngineState]) -> tuple[list[EngineState], list[EngineState]]:
        """(engines that may answer, dedicated prefill engines) among ``engines``. With dedicated prefill or
        decode engines, answers come from decode-capable engines and long uncached prompts are prefilled
        elsewhere; with only "both" engines every engine does everything. Roles are configuration, and a
        model's engine list is one object until the fleet rebuilds it: the split is kept for the last list."""
        memo = self._roles_memo
        if memo is not None and memo[0] is engines:
            return memo[1], memo[2]
        disaggregated = any(e.role is not Role.BOTH for e in engines)
        answering = [e for e in engines if e.role is not Role.PREFILL] if disaggregated else engines
        prefilling = [e for e in engines if e.role is not Role.DECODE] if disaggregated else []
        self._roles_memo = (engines, answering, prefilling)  # (holding the list: its id is not reused)
        return answering, prefilling

    def cached_tokens(
        self, ask: RoutingAsk, engines: Sequence[EngineState]
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Leading prompt tokens each engine holds by the residency view, and of those what its KV events
        confirmed (one walk gives both): whole blocks of the size it is routed in (its own, or for
        vLLM/SGLang at least ``min_block_size``), and never the prompt's last token, which every engine
        computes (its logits start the decode): a prompt of whole blocks finds one block less. (``prompt -
        1`` rounded down to an engine's blocks, then to routing blocks of several of them, is ``prompt - 1``
        rounded down to routing blocks.)"""
        default, minimum = self.settings.block_size, self.settings.min_block_size
        found = {key: self.state.lookup_confirmed(chain) for key, chain in ask.chains.items()}
        cap_blocks = max(0, ask.prompt_tokens - 1)
        cached: dict[str, int] = {}
        confirmed: dict[str, int] = {}
        for e in engines:
            key = e.chain_key(default, minimum)
            if key not in found:
                continue
            held, sure = found[key]
            blocks = held.get(e.id, 0)
            if blocks:
                size = key.block_size
                cached[e.id] = min(blocks, cap_blocks // size) * size
                if sure.get(e.id):
                    sure_blocks = min(sure[e.id], cap_blocks // size)
                    if e.prefill.tokens:  # (announced blocks of a prompt still in its prefill: not yet)
                        sure_blocks = e.prefill.computed_blocks(ask.chains[key], sure_blocks)
                    confirmed[e.id] = sure_blocks * size
        return cached, confirmed

    def _with_room(self, engines: list[EngineState], model: str) -> list[EngineState]:
        """Admission control: engines at their limits take nothing more. When every available engine is
        saturated the request is refused at once (503 with Retry-After) rather than queued without bound."""
        r = self.settings.resilience
        limit = r.max_waiting_per_engine
        open_ = [
            e
            for e in engines
            if e.inflight < r.max_inflight_per_engine
            # (The reading's queue, less this gateway's requests that have ended since it was taken: asked
            # only of a reading at the limit, so the common case costs one comparison.)
            and (e.load.waiting < limit or e.queue_estimate()[1] < limit)
        ]
        if (
            len(open_) < len(engines)
            and not any(e.available for e in open_)
            and any(e.available for e in engines)
        ):
            if self.metrics is not None:
                self.metrics.refused_admission(model)
            raise Overloaded(
                "every engine serving this model is at its queue limit; retry shortly",
                headers=retry_after_headers(NO_ENGINE_RETRY_AFTER_S),
            )
        return open_

    def candidates(
        self,
        engines: Sequence[EngineState],
        cached: dict[str, int],
        home: str,
        confirmed: dict[str, int] | None = None,
    ) -> list[Candidate]:
        out = []
        rtt_s, held = self.fleet.rtt_s, self.state.held_blocks
        default, minimum = self.settings.block_size, self.settings.min_block_size
        now, s_per_token = self._monotonic(), self.settings.routing.prefill_s_per_token
        for e in engines:
            total, waiting = e.queue_estimate()
            queued = e.queued_prefill_tokens(now, s_per_token)
            # Positional: a NamedTuple built with keywords takes twice as long, once per engine per request.
            out.append(
                Candidate(e.id, e.region, e.available, total, waiting, cached.get(e.id, 0),
                          rtt_s(e.region, home), queued, None, 0, e.waits_for_room(queued),
                          held(e.id) * e.chain_key(default, minimum).block_size)
            )  # fmt: skip
        if not self.policy.pulls_kv:
            return out
        # Pulls move blocks between engines that name them alike: kvgate engines of the gateway's block size.
        block_size = self.settings.block_size
        pulling = {e.id for e in engines if e.kv_pull and e.block_size in (None, block_size)}
        return with_peers(out, pulling, confirmed if confirmed is not None else cached) if pulling else out

    # -- the decision ----------------------------------------------------------------------------------

    def decide(self, plan: Plan) -> Route | GatewayError:
        """The next attempt's engine, committed; or the error to answer when no engine is left. Call it
        again after a failed attempt (``failed``): what failed is left out."""
        ask = plan.ask
        binding = (
            self.state.sessions.get_now(ask.tenant, ask.session_id) if ask.session_id is not None else None
        )
        self._seq += 1
        request = RouteRequest(
            prompt_tokens=ask.prompt_tokens,
            route_key=ask.route_key,
            seq=self._seq,
            session_engine=binding.engine if binding else None,
            home_region=ask.home_region,
        )
        error: GatewayError | None = None
        while True:
            engines = [e for e in plan.answering if e.id not in plan.excluded]
            candidates = self.candidates(engines, plan.cached, ask.home_region, plan.confirmed)
            eligible = self.limiter.eligible(ask.home_region, candidates, request.session_engine)
            decision = self.policy.pick(request, eligible)
            if decision is None:
                what = f"model '{ask.model}'"
                if ask.pinned_engine is not None:
                    what = f"the response this request continues (kept by engine {ask.pinned_engine})"
                return error or NoCapacity(
                    f"no healthy engine serves {what} right now",
                    headers=retry_after_headers(_back_in_s(engines)),
                )
            # A retry says so; so does a continuation, which only its engine could take (its prompt is not
            # hashed, so the policy would call it a miss and the metrics count a cache miss that was none).
            reason = (
                "failover" if plan.attempts else "stored_response" if ask.pinned_engine is not None else None
            )
            if reason is not None and decision.reason != reason:
                decision = RouteDecision(
                    decision.engine,
                    reason,
                    decision.cached_tokens,
                    decision.kv_source,
                    decision.pulled_tokens,
                )
            engine = self.fleet.engines[decision.engine]
            prefill: EngineState | None = None
            if plan.prefilling:
                prefill = self._prefill_for(plan, request, engine, decision, candidates)
                if prefill is None and prefills_elsewhere_only(engine):
                    plan.excluded.add(engine.id)
                    error = NoCapacity(
                        f"decode engine {engine.id} needs a prefill engine and none of its kind is available",
                        headers=retry_after_headers(NO_ENGINE_RETRY_AFTER_S),
                    )
                    continue
            plan.attempts += 1
            return self._commit(plan, decision, engine, prefill, binding)

    def pending_claim(self, plan: Plan) -> asyncio.Future[SessionBinding | None] | None:
        """The claim of the request's session still on its way to Redis (this request's or a parallel
        one's), if any: the request must not go anywhere before it is answered (``follow_claim``)."""
        ask = plan.ask
        if ask.session_id is None or not self.state.claims:
            return None
        return self.state.claims.get((ask.tenant, ask.session_id))

    async def follow_claim(
        self, plan: Plan, route: Route, claim: asyncio.Future[SessionBinding | None]
    ) -> Route | GatewayError:
        """Wait for the session's claim (one Redis round trip, for a session this gateway had not seen):
        the first claim in Redis wins. When another gateway's came first, the view now holds it: this
        attempt is taken back and decided again, following that binding."""
        try:
            held = await asyncio.shield(claim)
        except asyncio.CancelledError:
            # The client left while the claim travelled: the request goes nowhere, and its committed route
            # is taken back (before, its prompt stayed queued on the engine for good, and the session bound
            # there). Its queued prefill now; the rest once the claim is answered, so that the session's
            # release reaches Redis after the claim rather than being overtaken by it.
            route.settle()
            claim.add_done_callback(lambda _: self.release(route))
            raise
        lost = route.claimed is not None and held != route.claimed  # (this request's own claim lost)
        if held is None or (held.engine == route.engine.id and not lost):
            return route
        route.session = None  # (the view and Redis hold the winner already: nothing of ours to undo)
        self.release(route)
        plan.attempts -= 1
        return self.decide(plan)

    def _prefill_for(
        self,
        plan: Plan,
        request: RouteRequest,
        engine: EngineState,
        decision: RouteDecision,
        candidates: Sequence[Candidate],
    ) -> EngineState | None:
        chosen = next(c for c in candidates if c.engine == engine.id)
        if decision.kv_source is not None:  # what it will pull from a peer it need not prefill
            chosen = chosen._replace(cached_tokens=decision.pulled_tokens)
        # K/V moves only between engines of one kind: each kind has its own transfer protocol.
        able = [e for e in plan.prefilling if e.id not in plan.failed_prefill and e.kind is engine.kind]
        usable = self.candidates(able, plan.cached, plan.ask.home_region, plan.confirmed)
        local = not prefills_elsewhere_only(engine)
        pick = choose_prefill(request, chosen, usable, self.settings.routing, local_allowed=local)
        return self.fleet.engines[pick.engine] if pick else None

    def _commit(
        self,
        plan: Plan,
        decision: RouteDecision,
        engine: EngineState,
        prefill: EngineState | None,
        binding: SessionBinding | None,
    ) -> Route:
        """Make the decision visible to the next one before anything is awaited: the session's binding, the
        prompt's blocks as held soon on the engine, its uncached tokens as queued where it is computed."""
        ask, cached = plan.ask, plan.cached
        prompt = ask.prompt_tokens
        pulled = min(decision.pulled_tokens, prompt - 1) if prefill is None and decision.kv_source else 0
        predicted = min(max(decision.cached_tokens, pulled), prompt)
        if prefill is not None and prefill.kind is not EngineKind.KVGATE:
            # vLLM's and SGLang's decode engines report the prefill engine's cache hit as cached_tokens.
            predicted = cached.get(prefill.id, 0)
        computing = prefill or engine
        held = predicted if pulled else cached.get(computing.id, 0)
        queued = prompt - min(held, prompt)
        s = self.settings
        at = computing.chain_key(s.block_size, s.min_block_size)  # (its blocks from there on: not computed)
        start = cached.get(computing.id, 0) // at.block_size
        entry = computing.prefill.add(queued, self._monotonic(), ask.chains.get(at, ()), start)
        route = Route(decision, engine, prefill, predicted, pulled, computing, entry, clock=self._monotonic)
        if ask.session_id is not None and (binding is None or binding.engine != engine.id):
            made = SessionBinding(engine.region, engine.id, self._wall_clock())
            claimed = self.state.bind_session(ask.tenant, ask.session_id, made, claim=binding is None)
            route.session, route.claimed, route.previous = (ask.tenant, ask.session_id), claimed, binding
        key = engine.chain_key(s.block_size, s.min_block_size)
        known = cached.get(engine.id, 0) // key.block_size
        # The first new blocks only, until the engine's events (or the confirmation) say the rest: enough to
        # steer a twin decided before the events arrive, without paying per block for a long prompt twice.
        route.held_soon = ask.chains.get(key, [])[known : known + PENDING_MAX_BLOCKS]
        self.state.hold_soon(engine.id, route.held_soon, s.pending_ttl_s)
        self.limiter.record(ask.home_region, engine.region)
        return route

    def failed(self, plan: Plan, route: Route, *, prefill_only: bool) -> None:
        """The attempt failed before the engine took the request: take its claim back and leave the engine
        (or, when only its K/V transfer broke, the prefill engine) out of the next attempt."""
        self.release(route)
        if prefill_only and route.prefill is not None:
            plan.failed_prefill.add(route.prefill.id)  # same decode engine, another prefill engine (or local)
        else:
            plan.excluded.add(route.engine.id)

    def release(self, route: Route) -> None:
        route.settle()
        if route.session is not None and route.claimed is not None:
            tenant, session_id = route.session
            self.state.release_session(tenant, session_id, route.claimed, route.previous)
            route.session = None
        if route.held_soon:
            self.state.forget_soon(route.engine.id, route.held_soon)
            route.held_soon = []

    def confirm(self, route: Route, ask: RoutingAsk, *, computed: bool = True) -> None:
        """The engine took the request: remember where the prefix went for good. An engine that publishes KV
        events will announce the blocks itself; for one that does not, this record is all anyone will know,
        so it is shared with the other gateways and lives ``approx_ttl_s``. Not ``computed``: the engine
        answered with an error of its own (a 4xx, about the request) and computed nothing of the prompt.
        Its claim is taken back as for a failed attempt: recorded, the prompt was counted as cached there for
        ``approx_ttl_s`` by every gateway, and the session bound to an engine that had refused it."""
        engine, s = route.engine, self.settings
        if not computed:
            self.release(route)
        elif engine.kv_events:
            engine.awaited_blocks += len(route.held_soon)
        else:
            key = engine.chain_key(s.block_size, s.min_block_size)
            self.state.record_route(engine.id, ask.chains.get(key, []), s.approx_ttl_s, share=True)
            self.state.forget_soon(engine.id, route.held_soon)  # (the record covers them now)
        route.held_soon = []  # (no longer ours to take back)
        if self.metrics is not None:
            d = route.decision
            self.metrics.routed(engine.region, engine.id, d.reason, route.predicted, ask.home_region)


def _back_in_s(engines: Sequence[EngineState]) -> float:
    """When to come back for a request no engine took: when the first of them is let through again, if
    every one is healthy and held out by its breaker (engines that said they are busy for 30 s, say: a
    client told 1 s retried into the same refusal, and the SDK gave up before any engine was back);
    else ``NO_ENGINE_RETRY_AFTER_S`` (an unhealthy engine may be back any time)."""
    waits = [e.breaker.reopens_in() for e in engines]
    if engines and all(e.healthy for e in engines) and all(w > 0 for w in waits):
        return min(waits)
    return NO_ENGINE_RETRY_AFTER_S
