"""gateway.routing.router's plan: which engines may answer and which prefill, as the fleet says now."""

from __future__ import annotations

from gateway.app import GATEWAY, build_app
from gateway.config import parse_config
from gateway.prepared import Prepared
from gateway.service import Gateway
from tests.client_request import BareRequest

MODEL = "m"


def gateway_of(count: int) -> Gateway:
    engines = [{"name": f"e{i}", "url": f"http://127.0.0.1:{9100 + i}", "model": MODEL} for i in range(count)]
    config = parse_config({"region": "r", "regions": [{"name": "r", "engines": engines}],
                           "gateway": {"access_log": False}})  # fmt: skip
    gateway = build_app(config)[GATEWAY]
    for engine in gateway.fleet:
        engine.healthy = True
    return gateway


async def prepared(gateway: Gateway) -> Prepared:
    body = {"model": MODEL, "prompt": list(range(1, 100)), "max_tokens": 4}
    return await gateway.prepare.completion(BareRequest(), body)


async def test_a_role_an_engine_reports_later_changes_the_plan() -> None:
    gateway = gateway_of(3)
    p = await prepared(gateway)
    plan = gateway.router.plan(p)
    assert [e.id for e in plan.answering] == ["r/e0", "r/e1", "r/e2"] and plan.prefilling == []
    # e0 turns out to be a prefill engine: its health says so, and the health poller rebuilds the table.
    e0 = gateway.fleet.engines["r/e0"]
    if e0.apply_health({"model": MODEL, "role": "prefill"}):
        gateway.fleet.refresh_models()
    plan = gateway.router.plan(p)
    assert [e.id for e in plan.answering] == ["r/e1", "r/e2"]
    assert [e.id for e in plan.prefilling] == ["r/e0", "r/e1", "r/e2"]  # ("both" engines prefill too)
    # ... and reports "both" again.
    if e0.apply_health({"model": MODEL, "role": "both"}):
        gateway.fleet.refresh_models()
    plan = gateway.router.plan(p)
    assert [e.id for e in plan.answering] == ["r/e0", "r/e1", "r/e2"] and plan.prefilling == []


def test_a_health_report_that_changes_nothing_keeps_the_table() -> None:
    gateway = gateway_of(2)
    e0 = gateway.fleet.engines["r/e0"]
    assert e0.apply_health({"model": MODEL, "role": "prefill"}) is True
    assert e0.apply_health({"model": MODEL, "role": "prefill"}) is False


async def test_each_candidate_says_whether_its_queue_may_wait_for_a_slot_or_kv_as_reported() -> None:
    gateway = gateway_of(3)
    p = await prepared(gateway)
    e0, e1, e2 = (gateway.fleet.engines[f"r/e{i}"] for i in range(3))
    # e0: 9 waiting, 2 of its 4 slots taken, 300 free blocks of 16 tokens for its 4,000 queued prompt tokens:
    # its queue waits for prefill budget. e1: every slot taken. e2: nothing reported (its load is ours).
    room = {"running": 2, "waiting": 9, "waiting_tokens": 4_000, "max_running": 4, "kv_blocks_free": 300}
    e0.apply_health({"model": MODEL, "block_size": 16, "load": room})
    e1.apply_health({"model": MODEL, "block_size": 16, "load": room | {"running": 4}})
    plan = gateway.router.plan(p)
    candidates = {c.engine: c for c in gateway.router.candidates(plan.answering, {}, "r")}
    assert candidates["r/e0"].waiting == 9 and candidates["r/e0"].queued_prefill_tokens == 4_000
    assert [candidates[e.id].waits_for_room for e in (e0, e1, e2)] == [False, True, True]


async def test_each_candidate_says_how_many_tokens_its_cache_holds_in_its_own_block_size() -> None:
    """The emptier-cache tie-break compares engines of different block sizes: 100 blocks of 32 tokens are
    more cache than 150 blocks of 16. Compared as blocks, the engine of larger blocks looked emptier."""
    gateway = gateway_of(2)
    e0, e1 = (gateway.fleet.engines[f"r/e{i}"] for i in range(2))
    e0.apply_health({"model": MODEL, "block_size": 16})
    e1.apply_health({"model": MODEL, "block_size": 32})
    gateway.state.index.add_now("r/e0", list(range(150)))
    gateway.state.index.add_now("r/e1", list(range(1000, 1100)))
    plan = gateway.router.plan(await prepared(gateway))
    candidates = {c.engine: c for c in gateway.router.candidates(plan.answering, {}, "r")}
    assert (candidates["r/e0"].held_tokens, candidates["r/e1"].held_tokens) == (2_400, 3_200)


async def test_a_responses_request_is_answered_whole_and_a_continued_one_where_it_is_kept() -> None:
    # A dedicated prefill engine would keep a response of its own, and the P/D protocols hand K/V over for
    # completions only: a Responses request is answered whole by one engine.
    gateway = gateway_of(3)
    e0 = gateway.fleet.engines["r/e0"]
    if e0.apply_health({"model": MODEL, "role": "prefill"}):
        gateway.fleet.refresh_models()
    p = await gateway.prepare.responses(BareRequest(), {"model": MODEL, "input": "hello"})
    plan = gateway.router.plan(p)
    assert [e.id for e in plan.answering] == ["r/e1", "r/e2"] and plan.prefilling == []
    assert [e.id for e in gateway.router.plan(await prepared(gateway)).prefilling] == ["r/e0", "r/e1", "r/e2"]
    # One continuing a stored response goes only where that response is kept; its prompt starts with
    # history the gateway never saw, so no block of it is hashed.
    body = {"model": MODEL, "input": "and then?", "previous_response_id": "resp_1"}
    p = await gateway.prepare.responses(BareRequest(), body)
    p.pinned_engine = "r/e2"
    plan = gateway.router.plan(p)
    assert [e.id for e in plan.answering] == ["r/e2"] and plan.prefilling == []
    assert all(chain == [] for chain in p.chains.values()) and len(p.token_ids) > 0
