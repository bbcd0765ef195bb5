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
from pydantic import BaseModel, ConfigDict, Field


class RoutingSettings(BaseModel):
    """Knobs shared by the policies (the ``[gateway.routing]`` table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: str = Field(
        default="default", description="default | cache_aware | session | least_load | round_robin"
    )
    prefill_s_per_token: float = Field(default=5e-5, ge=0, description="estimated cost of one uncached token")
    # The next three are in prefill tokens (of prefill_s_per_token each), not seconds, so that one table
    # suits an 8B engine and a 70B one alike: a margin that matters is a fraction of a prompt's prefill,
    # whatever the engine's speed.
    load_penalty_tokens: float = Field(
        default=40.0, ge=0, description="estimated delay per request already running, in prefill tokens"
    )
    max_waiting: int = Field(
        default=8, ge=1, description="load guard: an engine with this many queued requests is overloaded"
    )
    tie_tolerance_tokens: float = Field(
        default=20.0, ge=0, description="estimates this close (in prefill tokens) are a tie"
    )
    tie_tolerance_frac: float = Field(
        default=0.05,
        ge=0,
        description="... or this close relative to the best: then home, load and hashing decide",
    )
    session_slack_tokens: float = Field(
        default=1000.0,
        ge=0,
        description="a session moves only if another engine is faster by this many prefill tokens' time",
    )
    session_slack_frac: float = Field(
        default=1.0,
        ge=0,
        description="... and faster by this many times the prefill its cached prefix would cost elsewhere",
    )
    # The same three in seconds, as earlier releases took them: when given, a figure overrides the
    # token one. A fixed time suits one engine speed only; the token figures are preferred.
    load_penalty_s: float | None = Field(default=None, ge=0, description="load_penalty_tokens in seconds")
    tie_tolerance_s: float | None = Field(default=None, ge=0, description="tie_tolerance_tokens in seconds")
    session_slack_s: float | None = Field(default=None, ge=0, description="session_slack_tokens in seconds")
    max_remote_share: float = Field(
        default=0.2, ge=0, le=1, description="the most of a home region's recent traffic served elsewhere"
    )
    kv_pull: bool = Field(
        default=True,
        description="default policy: an engine may pull a prefix its region's peer holds, not recompute it",
    )
    kv_pull_s_per_token: float = Field(
        default=1.2e-5,
        ge=0,
        description="estimated cost of pulling one token's K/V from a peer engine in the same region",
    )
    kv_pull_min_tokens: int = Field(
        default=512,
        ge=0,
        description="a peer's prefix is pulled only when it holds at least this many more tokens",
    )
    local_prefill_max_tokens: int = Field(
        default=256,
        ge=0,
        description="disaggregation: a decode engine prefills at most this many uncached tokens itself",
    )

    def seconds(self, tokens: float, override_s: float | None) -> float:
        """``tokens`` of prefill in seconds, or ``override_s`` when the configuration gave seconds."""
        return tokens * self.prefill_s_per_token if override_s is None else override_s

    @property
    def load_penalty(self) -> float:
        """Seconds per request already running on an engine (``load_penalty_tokens``)."""
        return self.seconds(self.load_penalty_tokens, self.load_penalty_s)

    @property
    def tie_tolerance(self) -> float:
        """Seconds within which two estimates tie (``tie_tolerance_tokens``)."""
        return self.seconds(self.tie_tolerance_tokens, self.tie_tolerance_s)

    @property
    def session_slack(self) -> float:
        """Seconds another engine must save before a session moves (``session_slack_tokens``)."""
        return self.seconds(self.session_slack_tokens, self.session_slack_s)


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

    def with_peer(self, peer: str, peer_tokens: int) -> Candidate:
        """This candidate with a peer (built directly: ``_replace`` takes twice as long)."""
        return Candidate(self.engine, self.region, self.healthy, self.load, self.waiting, self.cached_tokens,
                         self.rtt_s, self.queued_prefill_tokens, peer, peer_tokens)  # fmt: skip


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
    reason: str  # session | prefix | miss | moved | least_load | round_robin
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
    """The per-candidate load guard. Deliberately not a fleet-wide average: that would switch affinity off
    for everyone as soon as the fleet is busy."""
    return candidate.waiting >= settings.max_waiting


def without_engine(
    candidates: Sequence[Candidate], engine: str, settings: RoutingSettings
) -> list[Candidate]:
    """The candidates a session evicted from ``engine`` may move to: healthy, not overloaded, not ``engine``.
    When every other engine is overloaded too, all healthy ones stay eligible (least bad beats none)."""
    others = [c for c in candidates if c.engine != engine and c.healthy]
    return [c for c in others if not overloaded(c, settings)] or others
