"""Least load: the healthy candidate with the fewest requests in it; ties broken by rendezvous hashing of
the route key, so equal engines share new work evenly but one conversation keeps its tie-break."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings, healthy, rendezvous


class LeastLoadPolicy:
    name = "least_load"
    pulls_kv = False

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        usable = healthy(candidates)
        if not usable:
            return None
        chosen = min(usable, key=lambda c: (c.load, -rendezvous(request.route_key, c.engine)))
        return RouteDecision(chosen.engine, "least_load", chosen.cached_tokens)
