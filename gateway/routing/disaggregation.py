"""Prefill/decode disaggregation: where a request's prompt is prefilled when decode engines exist.

The decode engine is chosen first, by the regular policy over the decode-capable engines (its session, its
cached prefix, its load). Then, conditional disaggregation: if the part of the prompt that engine does not
hold is at most ``local_prefill_max_tokens``, it prefills that part itself and no K/V moves. Otherwise the
prompt goes to the prefill engine with the lowest estimated prefill time (cache overlap and queue, the
cache-aware estimate), and the decode engine pulls the K/V it lacks from there. A pure function, like the
policies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingSettings
from gateway.routing.cache_aware import CacheAwarePolicy


def choose_prefill(
    request: RouteRequest,
    decode: Candidate,
    prefill_candidates: Sequence[Candidate],
    settings: RoutingSettings,
) -> RouteDecision | None:
    """The engine that prefills for ``decode``, or None when ``decode`` should prefill locally."""
    held = min(decode.cached_blocks * request.block_size, request.prompt_tokens)
    if request.prompt_tokens - held <= settings.local_prefill_max_tokens:
        return None
    others = [c for c in prefill_candidates if c.engine != decode.engine]
    if not others:
        return None
    # A session binds the decode engine, not the prefill one: the prefill choice is cache and queue only.
    return CacheAwarePolicy(settings).pick(dataclasses.replace(request, session_engine=None), others)
