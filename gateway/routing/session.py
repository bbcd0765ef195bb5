"""Session affinity: stay on the engine the ``x-session-affinity`` binding names, unless that engine is
unhealthy, or overloaded (the per-candidate load guard) while another engine has room; then, and for new
sessions, least load decides."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.routing.base import (
    Candidate,
    RouteDecision,
    RouteRequest,
    RoutingSettings,
    has_room,
    overloaded,
    without_engine,
)
from gateway.routing.least_load import LeastLoadPolicy


def affinity_pick(
    request: RouteRequest,
    candidates: Sequence[Candidate],
    settings: RoutingSettings,
) -> tuple[RouteDecision | None, Sequence[Candidate]]:
    """(decision, candidates) when the binding holds; otherwise (None, the candidates the fallback may choose
    from): everything for a new session, the engines with room (``has_room``) for a session its overloaded
    engine gives up, everything but the rejected engine for a session whose engine is unhealthy or gone.

    The binding holds while its engine is healthy and not overloaded, or overloaded while no other engine has
    room. The guard moves a session only to an engine with room; moving it to another full queue would only
    give its cache up: under a sustained overload, sessions shuffled between full engines computed their
    prompts again, which deepened every queue (tests/bench/bench_overload.py)."""
    if request.session_engine is None:
        return None, candidates
    bound = next((c for c in candidates if c.engine == request.session_engine), None)
    if bound is None or not bound.healthy:
        return None, without_engine(candidates, request.session_engine, settings)
    if overloaded(bound, settings):
        room = [o for o in candidates if o is not bound and has_room(o, bound, settings)]
        if room:
            return None, room
    return RouteDecision(bound.engine, "session", bound.cached_tokens), candidates


class SessionPolicy:
    name = "session"
    pulls_kv = False

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings
        self._fallback = LeastLoadPolicy(settings)

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        kept, eligible = affinity_pick(request, candidates, self.settings)
        if kept is not None:
            return kept
        decision = self._fallback.pick(request, eligible)
        if decision is not None and request.session_engine is not None:
            return RouteDecision(decision.engine, "moved", decision.cached_tokens)
        return decision
