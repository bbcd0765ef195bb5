"""The default policy: session affinity, with the cache-aware estimate as its conscience, and KV pulls.

A request without a binding goes where its estimated time to first token is lowest (usually where its
prefix is cached; near-ties go home, then to the least loaded engine). A bound session stays on its engine
while that engine is healthy, not overloaded (or no other engine has room either), and not much slower than
the best alternative: a move must save more than ``session_slack_tokens`` of prefill time and more than
``session_slack_frac`` times what its cached prefix would cost on the new engine, and
``session_slack_frac_per_waiting`` times more for each request waiting there (a recomputed prefix delays
the requests queued behind it). A session that leaves its engine is reported as ``moved``.

What makes moving cheap is the pull: an engine may fetch the K/V of a prefix that a peer in its own region
holds instead of computing it (``kv_pull_s_per_token`` against ``prefill_s_per_token``, ~4x cheaper with
the defaults), and the peer then gives its copy up first. So the estimate of every candidate counts the
prefix its best same-region peer holds (``Candidate.peer``), a session leaves a queued engine taking its
cache along, and a new conversation whose prefix sits on a busy engine starts on an idle one without
recomputing it. On the Mooncake trace this gives the hit rate of never moving with a lower tail latency
than always choosing the fastest engine without pulls (tests/bench/bench_regions.py). The decision names
the peer (``kv_source``) and how many blocks to pull; the gateway passes both to the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings
from gateway.routing.cache_aware import CacheAwarePolicy
from gateway.routing.session import affinity_pick


class DefaultPolicy:
    name = "default"

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings
        self._cache_aware = CacheAwarePolicy(settings, kv_pull=settings.kv_pull)

    @property
    def pulls_kv(self) -> bool:
        return self._cache_aware.pulls_kv

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        kept, eligible = affinity_pick(request, candidates, self.settings)
        if kept is not None:
            bound = next(c for c in candidates if c.engine == kept.engine)
            if self._worth_staying(request, candidates, bound):
                return self._cache_aware.decision(request, bound, kept.reason)
        decision = self._cache_aware.pick(request, eligible)
        if decision is None or request.session_engine is None:
            return decision
        # The estimate may find the bound engine best after all: the session stayed, it did not move.
        stayed = decision.engine == request.session_engine
        return dataclasses.replace(decision, reason="session" if stayed else "moved")

    def _worth_staying(
        self, request: RouteRequest, candidates: Sequence[Candidate], bound: Candidate
    ) -> bool:
        estimate = self._cache_aware.estimate_ttft_s
        others = [c for c in candidates if c.healthy and c.engine != bound.engine]
        if not others:
            return True
        best = min(others, key=lambda c: estimate(request, c))
        saving = estimate(request, bound) - estimate(request, best)
        s = self.settings
        # What the cached prefix costs on the other engine: the part it holds is free, the part it can pull
        # costs the pull, the rest is computed again.
        held = min(bound.cached_tokens, request.prompt_tokens)
        there = min(best.cached_tokens, request.prompt_tokens)
        pulled = min(self._cache_aware.pulled_tokens(request, best), max(0, held - there))
        lost_s = pulled * s.kv_pull_s_per_token + max(0, held - there - pulled) * s.prefill_s_per_token
        # In a busy fleet, work added to the other engine also delays the requests that will queue behind it
        # there: about as many as wait there now.
        frac = s.session_slack_frac + s.session_slack_frac_per_waiting * best.waiting
        return saving <= max(s.session_slack, frac * lost_s)
