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
from region_map.config import EngineKind, Role
from region_map.fleet import EngineState


def choose_prefill(
    request: RouteRequest,
    decode: Candidate,
    prefill_candidates: Sequence[Candidate],
    settings: RoutingSettings,
    *,
    local_allowed: bool = True,
) -> RouteDecision | None:
    """The engine that prefills for ``decode``, or None when ``decode`` should prefill locally. Without
    ``local_allowed`` (an SGLang decode server, which cannot prefill) a prefill engine is always chosen."""
    held = min(decode.cached_tokens, request.prompt_tokens)
    if local_allowed and request.prompt_tokens - held <= settings.local_prefill_max_tokens:
        return None
    others = [c for c in prefill_candidates if c.engine != decode.engine]
    if not others:
        return None
    # A session binds the decode engine, not the prefill one: the prefill choice is cache and queue only.
    return CacheAwarePolicy(settings).pick(dataclasses.replace(request, session_engine=None), others)


def prefills_elsewhere_only(engine: EngineState) -> bool:
    """An SGLang decode server cannot prefill a prompt itself: every request it answers needs a prefill
    engine. kvgate and vLLM decode engines compute a short uncached part locally."""
    return engine.kind is EngineKind.SGLANG and engine.role is Role.DECODE
