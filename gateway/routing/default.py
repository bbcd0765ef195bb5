"""The default policy: session affinity, with the cache-aware estimate as its conscience.

A request without a binding goes where its estimated time to first token is lowest (usually where its
prefix is cached; near-ties go home, then to the least loaded engine). A bound session stays on its engine
while that engine is healthy, not overloaded, and not much slower than the best alternative: a move must
save more than ``session_slack_s`` and more than ``session_slack_frac`` times the prefill its cached prefix
would cost on the new engine. That keeps long conversations, whose caches are worth the most, in place,
while short ones move away from a queue; on the Mooncake trace it gives nearly the hit rate of never moving
with the tail latency of always choosing the fastest (tests/bench/bench_regions.py). A session that leaves
its engine is reported as ``moved``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings
from gateway.routing.cache_aware import CacheAwarePolicy
from gateway.routing.session import affinity_pick


class DefaultPolicy:
    name = "default"

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings
        self._cache_aware = CacheAwarePolicy(settings)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        kept, eligible = affinity_pick(request, candidates, self.settings)
        if kept is not None and self._worth_staying(request, candidates, kept):
            return kept
        decision = self._cache_aware.pick(request, eligible)
        if decision is not None and request.session_engine is not None:
            return RouteDecision(decision.engine, "moved", decision.cached_blocks)
        return decision

    def _worth_staying(
        self, request: RouteRequest, candidates: Sequence[Candidate], kept: RouteDecision
    ) -> bool:
        estimate = self._cache_aware.estimate_ttft_s
        bound = next(c for c in candidates if c.engine == kept.engine)
        others = [c for c in candidates if c.healthy and c.engine != bound.engine]
        if not others:
            return True
        best = min(others, key=lambda c: estimate(request, c))
        saving = estimate(request, bound) - estimate(request, best)
        lost_blocks = max(0, bound.cached_blocks - best.cached_blocks)
        lost_s = lost_blocks * request.block_size * self.settings.prefill_s_per_token
        s = self.settings
        return saving <= max(s.session_slack_s, s.session_slack_frac * lost_s)
