"""The default policy: session affinity first, the cache-aware estimate for everything else.

A bound session stays where it is while that engine is healthy and not overloaded. A request without a
binding goes where its estimated time to first token is lowest (usually where its prefix is cached). A
session whose engine fails the guard moves to the best of the other engines and is reported as ``moved``.
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
            return kept
        decision = self._cache_aware.pick(request, eligible)
        if decision is not None and request.session_engine is not None:
            return RouteDecision(decision.engine, "moved", decision.cached_blocks)
        return decision
