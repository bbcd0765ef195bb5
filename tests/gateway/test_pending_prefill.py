"""The gateway's own count of the prefill it has queued on an engine, and how it drains.

Between health polls the router knows an engine's prefill queue only from what it sent there. A prompt's
tokens leave that count when its first token comes back; until then the engine works through them at about
``prefill_s_per_token``, and the estimate says so. A request arriving near the end of a long prefill thus
sees the short wait that is left, not the whole prompt.
"""

from __future__ import annotations

from gateway.routing.base import route_key
from gateway.routing.default import DefaultPolicy
from gateway.routing.route import Route
from gateway.routing.settings import RoutingSettings
from gateway.simulate import TENANT, SimRouter, TraceAsk, sim_router
from region_map.fleet import ChainKey
from region_map.prefill_queue import PrefillQueue

S_PER_TOKEN = 7.1e-5  # a 70B model on H100s (perfmodel's llama3-70b-h100)
BLOCK = 512


def two_pulling_engines() -> SimRouter:
    """A router in front of two engines of one region that pull K/V from each other, at a 70B's speeds."""
    settings = RoutingSettings(
        prefill_s_per_token=S_PER_TOKEN, kv_pull=True, kv_pull_s_per_token=0.24 * S_PER_TOKEN
    )
    return sim_router(
        DefaultPolicy(settings), settings, regions=["r"], engines_per_region=2, rtt_s=0.0, uses_sessions=True,
        block_tokens=BLOCK,
    )  # fmt: skip


def test_the_oldest_queued_prefill_drains_at_the_estimated_speed() -> None:
    e = PrefillQueue()
    assert e.estimate(5.0, S_PER_TOKEN) == 0
    first = e.add(30_000, 10.0)  # a long prompt: ~2.1 s of prefill
    assert first is not None and e.estimate(10.0, S_PER_TOKEN) == 30_000
    one_second = int(1.0 / S_PER_TOKEN)
    assert e.estimate(11.0, S_PER_TOKEN) == 30_000 - one_second
    second = e.add(1_000, 11.0)  # queued behind it: the engine is still on the first
    assert second is not None and e.estimate(11.0, S_PER_TOKEN) == 31_000 - one_second
    # Only the oldest drains: however late its first token, what is queued behind it stays counted.
    assert e.estimate(60.0, S_PER_TOKEN) == 1_000
    e.settle(first, 12.5)  # its tokens flow: the engine is on the next one from now
    assert e.tokens == 1_000 and e.estimate(12.5, S_PER_TOKEN) == 1_000
    assert e.estimate(12.5 + 500 * S_PER_TOKEN, S_PER_TOKEN) == 500
    e.settle(second, 12.6)
    e.settle(second, 12.7)  # (twice: nothing more)
    assert e.tokens == 0 and e.estimate(12.7, S_PER_TOKEN) == 0
    assert e.add(0, 20.0) is None  # all cached: nothing queued
    later = e.add(200, 30.0)  # an idle engine starts on a new prompt when it arrives
    assert later is not None and e.estimate(30.0, S_PER_TOKEN) == 200
    assert e.estimate(31.0, 0.0) == 200  # no speed configured: no drain


def test_a_request_that_never_ran_leaves_the_oldest_draining() -> None:
    e = PrefillQueue()
    first, failed = e.add(20_000, 0.0), e.add(5_000, 0.5)
    assert first is not None and failed is not None
    e.settle(failed, 0.6)  # refused before the engine took it: not the one it is on
    assert e.estimate(1.0, S_PER_TOKEN) == 20_000 - int(1.0 / S_PER_TOKEN)


def test_a_follow_up_near_the_end_of_its_previous_turns_prefill_stays_and_finds_it() -> None:
    """The session's last turn (30k tokens, ~2.2 s) is 85 % through its prefill on its engine, whose KV events
    have announced its blocks, as vLLM's do when it schedules them. Counting that turn in full, the router
    saw 2.2 s of queue there and moved the session to the idle engine, to pull a prefix the busy engine had
    not computed yet (so the pull would find nothing, and all 30k tokens would be computed again)."""
    sim = two_pulling_engines()

    def decide(at: float, blocks: int) -> Route:
        sim.now[0] = at
        ask = TraceAsk("chat-7", "r", {ChainKey(BLOCK, True): list(range(blocks))}, blocks * BLOCK,
                       route_key(TENANT, "chat-7", []))  # fmt: skip
        route = sim.router.decide(sim.router.plan(ask))
        assert isinstance(route, Route)
        sim.router.confirm(route, ask)
        return route  # not settled: no token has come back yet

    first = decide(0.0, 60)
    sim.kv_changed(first.engine.id, list(range(60)), [])
    follow_up = decide(0.85 * 60 * BLOCK * S_PER_TOKEN, 62)
    assert follow_up.engine.id == first.engine.id and follow_up.decision.reason == "session"
    assert follow_up.decision.kv_source is None and follow_up.predicted == 60 * BLOCK


def test_a_prefix_still_in_its_prefill_is_priced_as_nothing_to_pull() -> None:
    """The same session's next turn, sent 10 % into its last turn's prefill. The busy engine has announced
    the blocks (at scheduling), but until its first token a peer pulling them would find most of them not
    computed. Priced as a pull of all 60 blocks, moving to the idle engine looked cheap (it pulled short and
    computed ~30k tokens again); priced as the recomputation it is, staying behind the prefill is cheaper,
    and there the blocks are computed by the time the next turn runs."""
    sim = two_pulling_engines()
    key = ChainKey(BLOCK, True)

    def ask(blocks: int, session: str = "chat-7") -> TraceAsk:
        chain = list(range(blocks)) if session == "chat-7" else [10_000 + i for i in range(blocks)]
        return TraceAsk(session, "r", {key: chain}, blocks * BLOCK, route_key(TENANT, session, []))

    first = sim.router.decide(sim.router.plan(ask(60)))
    assert isinstance(first, Route)
    sim.router.confirm(first, ask(60))
    sim.kv_changed(first.engine.id, list(range(60)), [])
    sim.now[0] = 0.1 * 60 * BLOCK * S_PER_TOKEN
    plan = sim.router.plan(ask(62))
    assert plan.cached[first.engine.id] == 60 * BLOCK  # it is held there (or will be) ...
    assert plan.confirmed is not None and plan.confirmed.get(first.engine.id, 0) == 0  # ... not pullable yet
    follow_up = sim.router.decide(plan)
    assert isinstance(follow_up, Route)
    assert follow_up.engine.id == first.engine.id and follow_up.decision.kv_source is None
    assert follow_up.predicted == 60 * BLOCK
    # Once its first token is back, the whole prefix can be pulled.
    first.settle()
    assert sim.router.plan(ask(62)).confirmed == {first.engine.id: 60 * BLOCK}


def test_a_queued_prompt_marks_where_its_uncomputed_blocks_begin() -> None:
    q = PrefillQueue()
    a = q.add(4 * BLOCK, 0.0, [1, 2, 3, 4, 5, 6], first_block=2)  # blocks 2.. of chain [1..6] to compute
    assert q.computed_blocks([1, 2, 3, 4, 5, 6, 7], 7) == 2  # the same prefix: only blocks 0-1 are computed
    assert q.computed_blocks([1, 2, 9, 9], 4) == 4  # another prompt branching at block 2: all computed
    assert q.computed_blocks([1, 2, 3], 1) == 1  # fewer announced than the mark: unchanged
    assert q.computed_blocks([1, 2], 2) == 2  # a shorter chain: nothing to compare
    b = q.add(BLOCK, 0.1, [1, 2], first_block=0)  # the whole of [1, 2] is being computed too
    assert q.computed_blocks([1, 2, 3, 4], 4) == 0
    assert b is not None and a is not None
    q.settle(b, 0.2)
    assert q.computed_blocks([1, 2, 3, 4], 4) == 2
    q.settle(a, 0.3)
    assert q.computed_blocks([1, 2, 3, 4], 4) == 4
    assert q.add(BLOCK, 0.4, [], first_block=0) is not None  # no chain (a prompt under one block): no mark
    assert q.computed_blocks([1, 2], 2) == 2
