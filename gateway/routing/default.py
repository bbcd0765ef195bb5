"""The default policy: session affinity first, the cache-aware estimate for everything else.

A bound session stays where it is while that engine is healthy and not overloaded, and, when that engine is
in another region than the client, while it still beats recomputing at home (round trip + its queue + its
uncached prefill against the best home engine's estimate). A request without a binding goes where its
estimated time to first token is lowest, usually where its prefix is cached. A session that leaves its
engine is reported as ``moved``.
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
        if kept is not None:
            home = self._faster_at_home(request, candidates, kept)
            if home is None:
                return kept
            eligible = home
        decision = self._cache_aware.pick(request, eligible)
        if decision is not None and request.session_engine is not None:
            return RouteDecision(decision.engine, "moved", decision.cached_blocks)
        return decision

    def _faster_at_home(
        self, request: RouteRequest, candidates: Sequence[Candidate], kept: RouteDecision
    ) -> list[Candidate] | None:
        """The home candidates, if the session's remote engine is slower than recomputing at home."""
        if request.home_region is None:
            return None
        bound = next(c for c in candidates if c.engine == kept.engine)
        if bound.region == request.home_region:
            return None
        home = [c for c in candidates if c.region == request.home_region and c.healthy]
        if not home:
            return None
        estimate = self._cache_aware.estimate_ttft_s
        best_home = min(estimate(request, c) for c in home)
        return home if best_home < estimate(request, bound) else None
