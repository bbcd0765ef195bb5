"""Round robin: the request counter modulo the healthy candidates. Ignores caches and load (a baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings, healthy


class RoundRobinPolicy:
    name = "round_robin"
    pulls_kv = False

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        usable = healthy(candidates)
        if not usable:
            return None
        chosen = usable[request.seq % len(usable)]
        return RouteDecision(chosen.engine, "round_robin", chosen.cached_tokens)
