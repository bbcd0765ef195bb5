"""Cache-aware: the candidate with the lowest estimated time to first token.

    ttft(c) = rtt(c)                                        network from this region
            + queued_prefill_tokens(c) · prefill_cost       prefill work already queued there
            + load(c) · load_penalty                        requests already running there
            + (prompt_tokens − cached_tokens(c)) · prefill_cost   this request's own uncached prefill

``cached_tokens`` comes from the residency index (longest cached prefix). Estimates within
``tie_tolerance_s`` of the best are ties, broken by rendezvous hashing of the route key: new conversations
spread over equal engines instead of piling onto the first. An engine that holds the prefix but is queued
deep loses to an idle one as soon as its queue costs more than the recomputation it would save.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings, healthy, rendezvous


class CacheAwarePolicy:
    name = "cache_aware"

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings

    def estimate_ttft_s(self, request: RouteRequest, candidate: Candidate) -> float:
        s = self.settings
        cached_tokens = min(candidate.cached_blocks * request.block_size, request.prompt_tokens)
        uncached = request.prompt_tokens - cached_tokens
        return (
            candidate.rtt_s
            + candidate.queued_prefill_tokens * s.prefill_s_per_token
            + candidate.load * s.load_penalty_s
            + uncached * s.prefill_s_per_token
        )

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        usable = healthy(candidates)
        if not usable:
            return None
        scored = [(self.estimate_ttft_s(request, c), c) for c in usable]
        best = min(t for t, _ in scored)
        tied = [c for t, c in scored if t <= best + self.settings.tie_tolerance_s]
        # Within the tolerance the cached blocks are worth nothing measurable: spread instead of letting a
        # shared system prompt pull every new conversation onto whichever engine cached it first.
        chosen = max(tied, key=lambda c: rendezvous(request.route_key, c.engine))
        return RouteDecision(
            chosen.engine, "prefix" if chosen.cached_blocks else "miss", chosen.cached_blocks
        )
