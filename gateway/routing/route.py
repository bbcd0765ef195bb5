"""A routing decision's inputs and its result, apart from the router that makes it: what routing reads of a
request (``RoutingAsk``), the counters it moves (``RoutingMetrics``), one request's inputs kept across its
attempts (``Plan``) and the committed decision (``Route``), which the gateway and ``kvgate simulate`` carry
from ``Router.decide`` to dispatch and back to ``Router.confirm``, ``release`` or ``failed``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from cache.sessions import SessionBinding
from gateway.routing.base import RouteDecision
from region_map.fleet import ChainKey, EngineState
from region_map.prefill_queue import QueuedPrefill


class RoutingAsk(Protocol):
    """What routing reads of a request (``gateway.prepare.Prepared`` is one)."""

    @property
    def tenant(self) -> str: ...
    @property
    def session_id(self) -> str | None: ...
    @property
    def model(self) -> str: ...
    @property
    def home_region(self) -> str: ...
    @property
    def tools(self) -> bool: ...
    @property
    def pinned_engine(self) -> str | None: ...  # the only engine that can answer it (a stored response's)
    @property
    def disaggregable(self) -> bool: ...  # whether a dedicated engine may prefill it
    @property
    def chains(self) -> dict[ChainKey, list[int]]: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def route_key(self) -> int: ...


class RoutingMetrics(Protocol):
    """The counters the router moves (``gateway.observability.metrics.GatewayMetrics``; None in the
    simulator)."""

    def routed(self, region: str, engine: str, reason: str, cached_tokens: int, home: str) -> None: ...
    def refused_admission(self, model: str) -> None: ...


@dataclass(slots=True)
class Plan:
    """One request's routing inputs, computed once and kept across its attempts."""

    ask: RoutingAsk
    answering: list[EngineState]  # engines that may answer (decode-capable), admission applied
    prefilling: list[EngineState]  # dedicated prefill engines (empty unless disaggregated)
    cached: dict[str, int]  # leading prompt tokens each engine holds, by the residency view
    confirmed: dict[str, int] | None  # ... by its KV events alone: what a peer can pull (None: no pulls)
    excluded: set[str] = field(default_factory=set)  # engines that failed this request before answering
    failed_prefill: set[str] = field(default_factory=set)  # prefill engines whose transfer broke
    attempts: int = 0


@dataclass(slots=True)
class Route:
    """A committed decision: where the request goes, what it is predicted to find there, and the claim
    made for it (undone by ``Router.release`` if the engine never takes the request)."""

    decision: RouteDecision
    engine: EngineState
    prefill: EngineState | None
    predicted: int  # cached tokens the answer should report
    pulled_tokens: int  # tokens the engine pulls from ``decision.kv_source`` (0: no pull)
    computing: EngineState  # where the prompt is prefilled: the prefill engine, or the engine itself
    queued: QueuedPrefill | None  # its uncached prompt tokens, noted as queued on ``computing`` until settled
    session: tuple[str, str] | None = None  # (tenant, session id) bound by this decision
    claimed: SessionBinding | None = None
    previous: SessionBinding | None = None
    held_soon: list[int] = field(default_factory=list)  # blocks noted on ``engine`` as held soon
    clock: Callable[[], float] = time.monotonic  # the router's, for the engine's prefill queue

    def settle(self) -> None:
        """The prompt's prefill is done (tokens flow) or will never run: its queued tokens leave the
        engine's load signal. Idempotent."""
        if self.queued is not None:
            self.computing.prefill.settle(self.queued, self.clock())
            self.queued = None
