"""Routing policies are pure picks: same inputs, same answer, nothing modified."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from gateway.routing import (
    POLICIES,
    CacheAwarePolicy,
    Candidate,
    DefaultPolicy,
    LeastLoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
    SessionPolicy,
)
from gateway.routing.base import RoutingSettings

S = RoutingSettings(prefill_s_per_token=1e-4, load_penalty_s=0.002, max_waiting=4, tie_tolerance_s=0.001)


def cand(
    name: str, *, cached: int = 0, load: int = 0, waiting: int = 0, healthy: bool = True, rtt: float = 0.0
) -> Candidate:
    return Candidate(name, "r", healthy, load, waiting, cached, rtt)


def req(*, tokens: int = 1024, key: int = 7, seq: int = 0, session: str | None = None) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, block_size=16, route_key=key, seq=seq, session_engine=session)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_is_deterministic_and_skips_unhealthy(name: str) -> None:
    policy = POLICIES[name](S)
    candidates = [cand("a", healthy=False, cached=60), cand("b", load=1), cand("c", cached=10)]
    frozen = list(candidates)
    first = policy.pick(req(session="a"), candidates)
    assert first is not None and first.engine != "a"
    assert policy.pick(req(session="a"), candidates) == first
    assert candidates == frozen
    assert policy.pick(req(), [cand("x", healthy=False)]) is None
    assert policy.pick(req(), []) is None


def test_round_robin_cycles() -> None:
    policy = RoundRobinPolicy(S)
    cs = [cand("a"), cand("b"), cand("c")]
    assert [policy.pick(req(seq=i), cs).engine for i in range(6)] == ["a", "b", "c", "a", "b", "c"]  # type: ignore[union-attr]


def test_least_load_picks_the_emptiest_and_spreads_ties() -> None:
    policy = LeastLoadPolicy(S)
    assert policy.pick(req(), [cand("a", load=3), cand("b", load=1), cand("c", load=2)]).engine == "b"  # type: ignore[union-attr]
    picks = Counter(policy.pick(req(key=k), [cand("a"), cand("b"), cand("c")]).engine for k in range(300))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 60


def test_cache_aware_prefers_the_longest_cached_prefix() -> None:
    policy = CacheAwarePolicy(S)
    decision = policy.pick(req(tokens=1024), [cand("a", cached=10), cand("b", cached=40), cand("c")])
    assert decision is not None and decision.engine == "b" and decision.reason == "prefix"
    assert decision.cached_blocks == 40


def test_cache_aware_leaves_a_cached_engine_whose_queue_costs_more_than_recomputing() -> None:
    policy = CacheAwarePolicy(S)
    busy = replace(cand("a", cached=10, load=50), queued_prefill_tokens=20_000)
    decision = policy.pick(req(tokens=1024), [busy, cand("b")])
    assert decision is not None and decision.engine == "b" and decision.reason == "miss"


def test_cache_aware_weighs_round_trips() -> None:
    policy = CacheAwarePolicy(S)
    # 32 cached blocks save 512 tokens x 0.1 ms = 51 ms: worth a 40 ms round trip, not a 100 ms one.
    near, far = cand("near"), cand("far", cached=32, rtt=0.040)
    assert policy.pick(req(), [near, far]).engine == "far"  # type: ignore[union-attr]
    assert policy.pick(req(), [near, replace(far, rtt_s=0.100)]).engine == "near"  # type: ignore[union-attr]


def test_cache_aware_spreads_new_prompts_over_equal_engines() -> None:
    policy = CacheAwarePolicy(S)
    cs = [cand("a"), cand("b"), cand("c"), cand("d")]
    picks = Counter(policy.pick(req(key=k), cs).engine for k in range(400))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c", "d"} and min(picks.values()) > 60


def test_the_session_policy_stays_even_without_cache_there() -> None:
    decision = SessionPolicy(S).pick(req(session="a"), [cand("a", load=3), cand("b", cached=60)])
    assert decision.engine == "a" and decision.reason == "session"


def test_the_default_policy_moves_a_session_only_for_a_real_gain() -> None:
    policy = DefaultPolicy(S)
    # b would save 32 ms of prefill: below the 100 ms slack, the session stays.
    decision = policy.pick(req(session="a"), [cand("a", load=3, cached=20), cand("b", cached=40)])
    assert decision.engine == "a" and decision.reason == "session"
    # b would save ~100 ms more than the 0.1 s slack and a holds nothing worth keeping: it moves.
    decision = policy.pick(req(session="a"), [cand("a", load=3), cand("b", cached=60)])
    assert decision.engine == "b" and decision.reason == "moved"
    # a's long cached prefix would cost 4 x its recompute to give up: it stays despite a queue.
    busy = replace(cand("a", cached=50, load=4), queued_prefill_tokens=2000)
    decision = policy.pick(req(tokens=1024, session="a"), [busy, cand("b")])
    assert decision.engine == "a" and decision.reason == "session"


@pytest.mark.parametrize("policy_cls", [SessionPolicy, DefaultPolicy])
def test_an_overloaded_session_engine_loses_the_session(policy_cls: type) -> None:
    policy = policy_cls(S)
    # a is the session's engine and holds the whole prefix, but its queue trips the guard.
    decision = policy.pick(
        req(session="a"), [cand("a", cached=60, waiting=4, load=20), cand("b"), cand("c", load=2)]
    )
    assert decision.engine != "a" and decision.reason == "moved"


def test_the_load_guard_is_per_candidate_not_fleet_wide() -> None:
    policy = DefaultPolicy(S)
    # Everyone else is drowning; the session's own engine is fine: the session stays.
    others = [cand(f"x{i}", waiting=10, load=30) for i in range(5)]
    decision = policy.pick(req(session="a"), [cand("a", load=2), *others])
    assert decision.engine == "a" and decision.reason == "session"


def test_when_every_engine_is_overloaded_a_moved_session_still_gets_one() -> None:
    policy = DefaultPolicy(S)
    decision = policy.pick(
        req(session="a"), [cand("a", waiting=9), cand("b", waiting=5), cand("c", waiting=6)]
    )
    assert decision is not None and decision.engine in {"b", "c"}


def test_default_routes_sessionless_requests_by_cache() -> None:
    policy = DefaultPolicy(S)
    decision = policy.pick(req(), [cand("a"), cand("b", cached=30)])
    assert decision.engine == "b" and decision.reason == "prefix"
