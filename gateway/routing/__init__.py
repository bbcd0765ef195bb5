"""Routing policies: each a pure pick over candidates (no side effects), one file per policy."""

from __future__ import annotations

from gateway.routing.base import Candidate, RouteDecision, RouteRequest, RoutingPolicy
from gateway.routing.cache_aware import CacheAwarePolicy
from gateway.routing.default import DefaultPolicy
from gateway.routing.least_load import LeastLoadPolicy
from gateway.routing.round_robin import RoundRobinPolicy
from gateway.routing.session import SessionPolicy

POLICIES: dict[str, type[RoutingPolicy]] = {
    "default": DefaultPolicy,
    "cache_aware": CacheAwarePolicy,
    "session": SessionPolicy,
    "least_load": LeastLoadPolicy,
    "round_robin": RoundRobinPolicy,
}

__all__ = [
    "POLICIES",
    "CacheAwarePolicy",
    "Candidate",
    "DefaultPolicy",
    "LeastLoadPolicy",
    "RoundRobinPolicy",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "SessionPolicy",
]
