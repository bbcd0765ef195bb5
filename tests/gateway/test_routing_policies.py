"""Routing policies are pure picks: same inputs, same answer, nothing modified."""

from __future__ import annotations

from collections import Counter

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
from gateway.routing.base import RoutingSettings, with_peers

BLOCK = 16  # tokens per block: ``cand(cached=n)`` holds n blocks
# Margins in prefill tokens of 1e-4 s: 2 ms per running request, ties within 1 ms, sessions moving for 50 ms.
S = RoutingSettings(
    prefill_s_per_token=1e-4,
    load_penalty_tokens=20,
    max_waiting=4,
    tie_tolerance_tokens=10,
    session_slack_tokens=500,
)


def cand(
    name: str, *, cached: int = 0, load: int = 0, waiting: int = 0, healthy: bool = True, rtt: float = 0.0
) -> Candidate:
    return Candidate(name, "r", healthy, load, waiting, cached * BLOCK, rtt)


def req(*, tokens: int = 1024, key: int = 7, seq: int = 0, session: str | None = None) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, route_key=key, seq=seq, session_engine=session)


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
    assert decision.cached_tokens == 40 * BLOCK


def test_cache_aware_leaves_a_cached_engine_whose_queue_costs_more_than_recomputing() -> None:
    policy = CacheAwarePolicy(S)
    busy = cand("a", cached=10, load=50)._replace(queued_prefill_tokens=20_000)
    decision = policy.pick(req(tokens=1024), [busy, cand("b")])
    assert decision is not None and decision.engine == "b" and decision.reason == "miss"


def test_cache_aware_weighs_round_trips() -> None:
    policy = CacheAwarePolicy(S)
    # 32 cached blocks save 512 tokens x 0.1 ms = 51 ms: worth a 40 ms round trip, not a 100 ms one.
    near, far = cand("near"), cand("far", cached=32, rtt=0.040)
    assert policy.pick(req(), [near, far]).engine == "far"  # type: ignore[union-attr]
    assert policy.pick(req(), [near, far._replace(rtt_s=0.100)]).engine == "near"  # type: ignore[union-attr]


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
    # b would save 38 ms of prefill: below the 50 ms slack, the session stays.
    decision = policy.pick(req(session="a"), [cand("a", load=3, cached=20), cand("b", cached=40)])
    assert decision.engine == "a" and decision.reason == "session"
    # b would save ~100 ms, more than the slack, and a holds nothing worth keeping: it moves.
    decision = policy.pick(req(session="a"), [cand("a", load=3), cand("b", cached=60)])
    assert decision.engine == "b" and decision.reason == "moved"
    # a's cached prefix (80 ms to recompute) is worth more than the 30 ms its queue costs: it stays.
    busy = cand("a", cached=50, load=4)._replace(queued_prefill_tokens=1000)
    decision = policy.pick(req(tokens=1024, session="a"), [busy, cand("b")])
    assert decision.engine == "a" and decision.reason == "session"
    # With a queue twice that long, moving saves more than the prefix would cost: it moves.
    busier = busy._replace(queued_prefill_tokens=2000)
    assert policy.pick(req(tokens=1024, session="a"), [busier, cand("b")]).reason == "moved"  # type: ignore[union-attr]


def peered(*candidates: Candidate, able: set[str] | None = None) -> list[Candidate]:
    return with_peers(candidates, able)


def test_peers_are_the_longest_holder_of_the_same_region() -> None:
    a, b, c = cand("a", cached=30), cand("b", cached=10), cand("c")
    far = cand("far", cached=60)._replace(region="elsewhere")
    sick = cand("sick", cached=90, healthy=False)
    out = {x.engine: x for x in peered(a, b, c, far, sick)}
    assert (out["b"].peer, out["b"].peer_tokens) == ("a", 30 * BLOCK)
    assert (out["c"].peer, out["c"].peer_tokens) == ("a", 30 * BLOCK)
    assert out["a"].peer is None  # its best peer, b, holds less than a itself
    assert out["far"].peer is None  # alone in its region: a peer never crosses regions
    # Only engines able to pull take part, as puller or as source.
    out = {x.engine: x for x in peered(a, b, c, able={"b", "c"})}
    assert out["c"].peer == "b" and out["b"].peer is None


def test_cache_aware_with_pulls_starts_on_an_idle_engine_with_a_busy_peers_prefix() -> None:
    settings = S.model_copy(update={"kv_pull_s_per_token": 2e-5, "kv_pull_min_tokens": 64})
    busy = cand("a", cached=60, load=4)._replace(queued_prefill_tokens=3000)
    candidates = peered(busy, cand("b"))
    # Without pulls the idle engine would recompute 1,024 tokens; with them it pulls a's 960.
    plain = CacheAwarePolicy(settings).pick(req(), candidates)
    assert plain is not None and plain.kv_source is None
    decision = CacheAwarePolicy(settings, kv_pull=True).pick(req(), candidates)
    assert decision is not None and decision.engine == "b" and decision.reason == "prefix"
    assert (decision.kv_source, decision.pulled_tokens, decision.cached_tokens) == ("a", 60 * BLOCK, 0)
    # A pull that costs as much as computing, or that is shorter than the minimum, is not worth asking for.
    for update in ({"kv_pull_s_per_token": 1e-4}, {"kv_pull_min_tokens": 2048}):
        costly = CacheAwarePolicy(settings.model_copy(update=update), kv_pull=True).pick(req(), candidates)
        assert costly is not None and costly.kv_source is None


def test_the_default_policy_takes_a_sessions_cache_along_when_it_moves() -> None:
    busy = cand("a", cached=60, load=4)._replace(queued_prefill_tokens=1000)
    candidates = peered(busy, cand("b"))
    # Without pulls a's prefix is worth its queue (see above) and the session stays queued.
    stays = DefaultPolicy(S.model_copy(update={"kv_pull": False})).pick(req(session="a"), candidates)
    assert stays is not None and stays.engine == "a" and stays.kv_source is None
    # With them, moving costs only the pull: the session moves to the idle engine and pulls its prefix.
    moved = DefaultPolicy(S).pick(req(session="a"), candidates)
    assert moved is not None and (moved.engine, moved.reason, moved.kv_source) == ("b", "moved", "a")
    assert moved.pulled_tokens == 60 * BLOCK


def test_a_session_that_stays_pulls_what_a_peer_holds_beyond_its_own() -> None:
    candidates = peered(cand("a", cached=10), cand("b", cached=60, load=9, waiting=3))
    decision = DefaultPolicy(S).pick(req(session="a"), candidates)
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")
    assert (decision.kv_source, decision.pulled_tokens, decision.cached_tokens) == (
        "b",
        60 * BLOCK,
        10 * BLOCK,
    )


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


@pytest.mark.parametrize("policy_cls", [SessionPolicy, DefaultPolicy])
def test_when_every_engine_is_overloaded_the_session_keeps_its_engine_and_cache(policy_cls: type) -> None:
    # Moving to another full queue gains nothing and gives the session's cache up; before, the guard moved
    # it anyway, and under a sustained overload those moves recomputed prompts and deepened every queue.
    policy = policy_cls(S)
    candidates = [cand("a", cached=60, waiting=9), cand("b", waiting=5), cand("c", waiting=6)]
    decision = policy.pick(req(session="a"), candidates)
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")
    # One engine with room is enough for the guard to move the session there.
    decision = policy.pick(req(session="a"), [*candidates, cand("d", waiting=3)])
    assert decision is not None and (decision.engine, decision.reason) == ("d", "moved")


@pytest.mark.parametrize("policy_cls", [SessionPolicy, DefaultPolicy])
def test_a_session_on_the_only_healthy_engine_is_served_when_that_engine_is_overloaded(
    policy_cls: type,
) -> None:
    # Before, the guard sent the session away with nowhere to go: no decision, and the gateway answered 503
    # "no healthy engine" to clients that sent x-session-affinity while it served those that did not.
    policy = policy_cls(S)
    for candidates in ([cand("a", waiting=9)], [cand("a", waiting=9), cand("b", healthy=False)]):
        decision = policy.pick(req(session="a"), candidates)
        assert decision is not None and (decision.engine, decision.reason) == ("a", "session")


def test_when_every_engine_is_overloaded_a_session_that_must_move_still_gets_one() -> None:
    policy = DefaultPolicy(S)
    decision = policy.pick(
        req(session="a"), [cand("a", waiting=9, healthy=False), cand("b", waiting=5), cand("c", waiting=6)]
    )
    assert decision is not None and decision.engine in {"b", "c"}


def queued(c: Candidate, tokens: int) -> Candidate:
    """``c`` with ``tokens`` of prefill queued."""
    return c._replace(queued_prefill_tokens=tokens)


@pytest.mark.parametrize("policy_cls", [SessionPolicy, DefaultPolicy])
def test_the_load_guard_moves_a_session_only_to_an_engine_with_at_most_half_its_waiting_requests(
    policy_cls: type,
) -> None:
    # a has 5 requests queued (the guard's 4 and more), b 3, and about as many tokens (20.0k against 19.9k).
    # Before, the guard moved the session to b (not overloaded) and its 960 cached tokens were computed
    # again: on the synthetic trace's overloaded windows, most of what kvgate lost to routers that stay with
    # the cache was such moves, from 8 waiting requests to 7. The estimate sees both queues, and stays.
    policy = policy_cls(S)
    a, b = queued(cand("a", cached=60, waiting=5), 20_000), queued(cand("b", waiting=3), 19_900)
    decision = policy.pick(req(session="a"), [a, b])
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")
    # Half as many waiting, or fewer: the guard moves it, whatever the estimate (blind to some queues).
    c = queued(cand("c", waiting=2), 19_900)
    decision = policy.pick(req(session="a"), [a, b, c])
    assert decision is not None and (decision.engine, decision.reason) == ("c", "moved")


@pytest.mark.parametrize("policy_cls", [SessionPolicy, DefaultPolicy])
def test_the_load_guard_leaves_a_session_where_its_queue_waits_only_for_prefill_budget(
    policy_cls: type,
) -> None:
    # a has 5 requests waiting (the guard's 4 and more) and 300 prompt tokens queued. When its report shows a
    # free slot and KV room for them (waits_for_room false), they wait for prefill budget, which the queued
    # tokens price: the estimate keeps the session (364 tokens of prefill against 1,024 on the idle b). The
    # guard, blind to tokens, moved it and computed its 960 cached tokens again.
    policy = policy_cls(S)
    a = queued(cand("a", cached=60, waiting=5), 300)
    budget_bound = a._replace(waits_for_room=False)
    decision = policy.pick(req(session="a"), [budget_bound, cand("b")])
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")
    # Waiting for a slot or for KV memory (or not known to wait for neither): the guard moves it.
    decision = policy.pick(req(session="a"), [a, cand("b")])
    assert decision is not None and (decision.engine, decision.reason) == ("b", "moved")


def test_a_session_moves_to_recompute_its_prefix_only_if_the_gain_outweighs_the_requests_it_delays() -> None:
    """Staying costs 3,064 tokens of prefill time (a queue of 3,000, then 64 uncached); moving to b costs
    2,024 (a queue of 1,000, then all 1,024 tokens, the 960 cached on a computed again). The gain, 1,040,
    exceeds the recomputation (960), so with b's queue in prefill the session moves. But if those 1,000
    tokens are a request waiting there, the recomputation also delays the requests that will queue behind
    it: about as many as wait there now. Charged for one more, the move no longer pays."""
    policy = DefaultPolicy(S)
    a = queued(cand("a", cached=60, waiting=2), 3_000)
    running = queued(cand("b"), 1_000)
    decision = policy.pick(req(session="a"), [a, running])
    assert decision is not None and (decision.engine, decision.reason) == ("b", "moved")
    waiting = queued(cand("b", waiting=1), 1_000)
    decision = policy.pick(req(session="a"), [a, waiting])
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")
    # The charge is a setting: without it (0), the move is made as before.
    uncharged = DefaultPolicy(S.model_copy(update={"session_slack_frac_per_waiting": 0.0}))
    decision = uncharged.pick(req(session="a"), [a, waiting])
    assert decision is not None and (decision.engine, decision.reason) == ("b", "moved")


def test_default_routes_sessionless_requests_by_cache() -> None:
    policy = DefaultPolicy(S)
    decision = policy.pick(req(), [cand("a"), cand("b", cached=30)])
    assert decision.engine == "b" and decision.reason == "prefix"


def test_a_tie_goes_to_the_emptier_cache_before_the_lighter_load() -> None:
    """A new prompt whose estimates tie (nothing of it cached, queues alike) goes where the cache holds the
    fewest blocks, before where the fewest requests run: placed in the fullest cache, its blocks evict other
    conversations' histories soonest. The load then breaks what the caches leave tied."""
    policy = CacheAwarePolicy(S)
    full, emptier, emptiest_but_busier = (
        cand("full")._replace(held_tokens=64_000),
        cand("emptier")._replace(held_tokens=40_000),
        cand("emptiest", load=1)._replace(held_tokens=30_000),
    )
    for candidates in ([full, emptier], [emptier, full]):
        decision = policy.pick(req(), candidates)
        assert decision is not None and decision.engine == "emptier"
    # A request's load penalty (40 tokens) is inside the tie tolerance: the emptiest cache wins regardless.
    assert policy.pick(req(), [full, emptier, emptiest_but_busier]).engine == "emptiest"  # type: ignore[union-attr]
    light = cand("light")._replace(held_tokens=30_000)
    assert policy.pick(req(), [light, emptiest_but_busier]).engine == "light"  # type: ignore[union-attr]


def test_with_peer_keeps_every_other_field() -> None:
    # Built field by field for speed: a field added to Candidate and forgotten there would fail here (every
    # field set, none at its default; typed by hand: compiled, with_peer checks the types it reads).
    fields = {"engine": "e", "region": "r", "healthy": False, "load": 5, "waiting": 2, "cached_tokens": 64,
              "rtt_s": 0.04, "queued_prefill_tokens": 300, "peer": "p", "peer_tokens": 128,
              "waits_for_room": False, "held_tokens": 700}  # fmt: skip
    assert set(fields) == set(Candidate._fields)
    c = Candidate(**fields)
    assert c.with_peer("peer-engine", 3) == c._replace(peer="peer-engine", peer_tokens=3)


def test_a_session_kept_by_the_estimate_after_all_is_reported_as_session_not_moved() -> None:
    """Staying was judged not worth it (no slack), yet the estimate's tie-break chose the bound engine: the
    session did not move, and the label must say so."""
    strict = RoutingSettings(
        prefill_s_per_token=1e-4, load_penalty_s=0.002, session_slack_s=0.0, session_slack_frac=0.0
    )
    bound = Candidate("a", "r", True, 0, 0, 0, 0.0, queued_prefill_tokens=4)  # 0.4 ms slower than b
    remote = cand("b", rtt=0.0001)  # a near-tie: home (rtt 0) wins it
    decision = DefaultPolicy(strict).pick(req(session="a"), [bound, remote])
    assert decision is not None and (decision.engine, decision.reason) == ("a", "session")


def test_the_margins_are_prefill_tokens_and_follow_the_engines_speed() -> None:
    fast, slow = RoutingSettings(prefill_s_per_token=3e-5), RoutingSettings(prefill_s_per_token=7.1e-5)
    for settings in (fast, slow):
        p = settings.prefill_s_per_token
        assert settings.session_slack == pytest.approx(settings.session_slack_tokens * p)
        assert settings.load_penalty == pytest.approx(settings.load_penalty_tokens * p)
        assert settings.tie_tolerance == pytest.approx(settings.tie_tolerance_tokens * p)
    assert slow.session_slack > fast.session_slack
    # A slower engine: the same queue and the same saving in tokens lead to the same decision.
    busy = cand("a", cached=60, load=4)._replace(queued_prefill_tokens=1000)
    for prefill_s in (3e-5, 7.1e-5, 1e-3):
        settings = S.model_copy(
            update={"prefill_s_per_token": prefill_s, "kv_pull_s_per_token": prefill_s / 4}
        )
        moved = DefaultPolicy(settings).pick(req(session="a"), peered(busy, cand("b")))
        assert moved is not None and moved.engine == "b", prefill_s


def test_the_margins_in_seconds_are_still_read_and_override() -> None:
    settings = RoutingSettings(prefill_s_per_token=1e-4, session_slack_s=0.5, load_penalty_s=0.0)
    assert settings.session_slack == 0.5 and settings.load_penalty == 0.0
    assert settings.tie_tolerance == pytest.approx(settings.tie_tolerance_tokens * 1e-4)
    with pytest.raises(ValueError):
        RoutingSettings(session_slack_tokens=-1)
