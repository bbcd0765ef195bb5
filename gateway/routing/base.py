"""What a routing policy sees and returns.

A policy is a pure function of (request, candidates): it reads, it never writes. The gateway owns every
side effect (counters, bindings, residency records), which keeps policies testable as plain functions and
lets the trace simulator run the very same objects.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import xxhash

# The knobs moved to a module of their own (a pydantic model stays Python in the compiled build); importable
# from here as before.
from gateway.routing.settings import RoutingSettings as RoutingSettings


class Candidate(NamedTuple):
    """An engine that could serve the request, as the gateway sees it right now. A NamedTuple, immutable
    like the frozen dataclasses around it but built in a third of the time: one per engine per request,
    twice when peers are filled in."""

    engine: str
    region: str
    healthy: bool
    load: int  # requests in the engine (running + waiting), reported or local, whichever is larger
    waiting: int  # requests waiting for a slot
    cached_tokens: int  # leading prompt tokens it holds: whole blocks of its own block size
    rtt_s: float  # round trip from this gateway's region
    queued_prefill_tokens: int = 0  # prompt tokens waiting there for prefill (reported, or sent by us)
    peer: str | None = None  # the same-region engine holding the longest prefix of this prompt, if not this
    peer_tokens: int = 0  # leading prompt tokens ``peer`` holds
    # Whether its waiting requests may wait for a slot or KV memory (EngineState.waits_for_room), not only for
    # prefill budget that ``queued_prefill_tokens`` prices: what the load guard is for.
    waits_for_room: bool = True
    # Tokens its cache holds by the residency view, whatever the prompt (blocks times its block size: engines
    # of other block sizes compare alike): how full its cache is.
    held_tokens: int = 0

    def with_peer(self, peer: str, peer_tokens: int) -> Candidate:
        """This candidate with a peer (built directly: ``_replace`` takes twice as long)."""
        return Candidate(self.engine, self.region, self.healthy, self.load, self.waiting, self.cached_tokens,
                         self.rtt_s, self.queued_prefill_tokens, peer, peer_tokens,
                         self.waits_for_room, self.held_tokens)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RouteRequest:
    prompt_tokens: int
    route_key: int  # stable per conversation when possible: session id or prompt-derived hash
    seq: int  # this gateway's request counter (round robin)
    session_engine: str | None = None  # engine the x-session-affinity binding points at
    home_region: str | None = None  # where the client is; candidates' rtt_s are measured from there


@dataclass(frozen=True, slots=True)
class RouteDecision:
    engine: str
    reason: str  # session | prefix | miss | moved | least_load | round_robin | failover | stored_response
    cached_tokens: int = 0  # leading prompt tokens the engine holds (whole blocks of its block size)
    kv_source: str | None = None  # engine to pull the prompt's K/V from before prefilling the rest
    pulled_tokens: int = 0  # leading prompt tokens to pull from ``kv_source`` (they include the cached ones)


class RoutingPolicy(Protocol):
    name: str

    @property
    def pulls_kv(self) -> bool:
        """Whether it reads ``Candidate.peer`` (the caller fills peers in only then)."""
        ...

    def __init__(self, settings: RoutingSettings) -> None: ...

    def pick(self, request: RouteRequest, candidates: Sequence[Candidate]) -> RouteDecision | None:
        """The engine to send ``request`` to, or None when no candidate is healthy. Must not modify
        anything: the same inputs always give the same answer."""
        ...


def route_key(tenant: str, session_id: str | None, hashes: Sequence[int], fallback: bytes = b"") -> int:
    """Stable for a conversation: its session when it sends one, else its prompt (a continuation is found
    by its prefix anyway, so the last block's hash only needs to spread new prompts)."""
    if session_id is not None:
        return xxhash.xxh3_64_intdigest(f"{tenant}\x00{session_id}".encode())
    if hashes:
        return hashes[-1]
    return xxhash.xxh3_64_intdigest(fallback)


def rendezvous(route_key: int, engine: str) -> int:
    """Highest-random-weight score: stable per (key, engine), so ties spread yet repeat for a key."""
    return xxhash.xxh3_64_intdigest(engine.encode(), seed=route_key)


def with_peers(
    candidates: Sequence[Candidate],
    able: Container[str] | None = None,
    sources: Mapping[str, int] | None = None,
) -> list[Candidate]:
    """``candidates`` with ``peer``/``peer_tokens`` filled in: for each, the healthy engine of its own region
    (not itself) holding the longest prefix of the prompt. Only engines in ``able`` (all when None) pull or
    are pulled from; ``sources`` says what each can give (default: its ``cached_tokens``; a prefix only
    "held soon", still being computed, cannot be pulled yet). Two passes over the candidates, whatever the
    number of cached prefixes: each region's best and second-best holder is all a peer lookup needs."""
    best: dict[str, tuple[tuple[int, str] | None, tuple[int, str] | None]] = {}
    for c in candidates:
        if not c.healthy or (able is not None and c.engine not in able):
            continue
        held = c.cached_tokens if sources is None else sources.get(c.engine, 0)
        if held == 0:
            continue
        first, second = best.get(c.region, (None, None))
        if first is None or held > first[0]:
            best[c.region] = ((held, c.engine), first)
        elif second is None or held > second[0]:
            best[c.region] = (first, (held, c.engine))
    out = []
    for c in candidates:
        first, second = best.get(c.region, (None, None))
        peer = second if first is not None and first[1] == c.engine else first
        if peer is not None and peer[0] > c.cached_tokens and (able is None or c.engine in able):
            c = c.with_peer(peer[1], peer[0])
        out.append(c)
    return out


def healthy(candidates: Sequence[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.healthy]


def overloaded(candidate: Candidate, settings: RoutingSettings) -> bool:
    """The per-candidate load guard: a safety net for queues the estimate cannot see, counted in requests
    (requests waiting for a slot or KV memory that decodes hold, prompts other gateways sent to an engine
    that reports no queued tokens). An engine whose report shows its queue waits only for prefill budget
    (``waits_for_room`` false) is never overloaded: its queued tokens price that wait, and the guard would
    only give its sessions' caches up. Deliberately not a fleet-wide average: that would switch affinity off
    for everyone as soon as the fleet is busy."""
    return candidate.waits_for_room and candidate.waiting >= settings.max_waiting


def has_room(other: Candidate, bound: Candidate, settings: RoutingSettings) -> bool:
    """Whether the load guard may move a session from its overloaded engine ``bound`` to ``other``: healthy,
    not overloaded, and with at most half as many requests waiting. A move gives the session's cache up, and
    the guard, blind to the tokens queued, must see a clear gain in the one measure it has: moved from 8
    waiting requests to 7, a session computed its prompt again for nothing (tests/bench/bench_overload.py)."""
    return other.healthy and not overloaded(other, settings) and 2 * other.waiting <= bound.waiting


def without_engine(
    candidates: Sequence[Candidate], engine: str, settings: RoutingSettings
) -> list[Candidate]:
    """The candidates a session evicted from ``engine`` may move to: healthy, not overloaded, not ``engine``.
    When every other engine is overloaded too, all healthy ones stay eligible (least bad beats none)."""
    others = [c for c in candidates if c.engine != engine and c.healthy]
    return [c for c in others if not overloaded(c, settings)] or others
