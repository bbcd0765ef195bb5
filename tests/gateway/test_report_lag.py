"""An engine's load reading counts requests that have ended since it was asked for (region_map.report_lag):
the router takes off what this gateway saw end, and nothing else."""

from __future__ import annotations

from pathlib import Path

from gateway.routing.base import RoutingSettings
from region_map.config import EngineConfig
from region_map.fleet import EngineState
from tests.harness import MODEL, ClusterFactory

S_PER_TOKEN = RoutingSettings().prefill_s_per_token


def engine() -> EngineState:
    state = EngineState(id="r/e0", region="r", config=EngineConfig(name="e0", url="http://127.0.0.1:1"))
    state.healthy = True
    return state


def reading(state: EngineState, **load: int) -> None:
    """A reading asked for now and answered at once with ``load``."""
    state.report_lag.asking()
    state.apply_health({"model": "m", "load": load})


def test_a_request_the_reading_counted_is_taken_off_once_it_has_ended() -> None:
    state = engine()
    mark = state.report_lag.sent()
    state.inflight += 1
    reading(state, running=0, waiting=1, waiting_tokens=700)  # it waited there when the engine was read
    assert state.queue_estimate()[0] == 1 and state.queued_prefill_tokens(0.0, S_PER_TOKEN) == 700
    state.inflight -= 1
    state.report_lag.request_ended(mark, 700)
    assert state.queue_estimate()[0] == 0
    assert state.queued_prefill_tokens(0.0, S_PER_TOKEN) == 0
    # The next reading no longer counts it: nothing is taken off twice.
    reading(state, running=2, waiting=0, waiting_tokens=0)
    assert state.queue_estimate()[0] == 2


def test_a_request_sent_after_the_reading_was_asked_takes_nothing_off_others_load() -> None:
    state = engine()
    reading(state, running=1, waiting=1, waiting_tokens=500)  # another gateway's requests
    mark = state.report_lag.sent()
    state.report_lag.request_ended(mark, 300)
    assert state.queue_estimate()[0] == 2
    assert state.queued_prefill_tokens(0.0, S_PER_TOKEN) == 500


def test_a_request_that_ended_before_the_reading_was_asked_is_not_taken_off_it() -> None:
    state = engine()
    reading(state, running=0)
    mark = state.report_lag.sent()
    reading(state, running=1)  # (counts it)
    state.report_lag.request_ended(mark, 100)
    reading(state, running=1, waiting_tokens=100)  # asked after it ended: what it counts is others'
    assert state.queue_estimate()[0] == 1
    assert state.queued_prefill_tokens(0.0, S_PER_TOKEN) == 100


async def test_the_next_turn_goes_to_its_prefix_though_the_last_reading_counts_the_turn_before(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    # kvgate's engines (a peer may pull the prefix: the router weighs that against the holder's queue). No
    # reading but the ones this test makes (the poller would read again within 50 ms).
    cluster = await make_cluster(
        {"r": 2}, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir), health_interval_s=3600.0
    )
    first = " ".join(f"word{i}" for i in range(100))
    assert cluster.session is not None
    async with cluster.session.post(
        cluster.url + "/v1/completions",
        json={"model": cluster.model, "prompt": first, "max_tokens": 8, "stream": True},
    ) as response:
        holder = cluster.gateway.fleet.engines[response.headers["x-kvgate-engine"]]
        await response.content.readany()
        # The engine is read while the turn is in it (queued, as a busy engine would have it): that reading
        # stays the engine's word until the next one.
        prompt_tokens = len(cluster.gateway.prepare.tokenizer.encode(first)) + 1  # (and its BOS)
        reading(holder, running=0, waiting=1, waiting_tokens=prompt_tokens)
        await response.read()
    status, body, headers = await cluster.post(
        "/v1/completions", {"model": cluster.model, "prompt": first + " and more", "max_tokens": 2}
    )
    assert status == 200, body
    assert headers["x-kvgate-engine"] == holder.id
    assert headers["x-kvgate-route"] == "prefix"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_queue_this_gateway_saw_end_does_not_move_a_session_off_its_engine(
    make_cluster: ClusterFactory,
) -> None:
    # The load guard counts waiting requests (max_waiting, 8): a reading that found 8 of this gateway's
    # requests queued, all ended since, took them off the engine's requests but not off its queue, and the
    # session's next turn was moved to the idle engine, giving its cache up.
    cluster = await make_cluster({"r": 2}, health_interval_s=3600.0)
    session = {"x-session-affinity": "agent-1"}
    body = {"model": MODEL, "prompt": " ".join(f"w{i}" for i in range(40)), "max_tokens": 2}
    status, answer, headers = await cluster.post("/v1/completions", body, headers=session)
    assert status == 200, answer
    holder = cluster.gateway.fleet.engines[headers["x-kvgate-engine"]]
    marks = [holder.report_lag.sent() for _ in range(8)]
    reading(holder, running=0, waiting=8, waiting_tokens=800)  # (no slot limit reported: the guard counts)
    for mark in marks:
        holder.report_lag.request_ended(mark, 100)
    assert holder.queue_estimate() == (0, 0)
    status, answer, headers = await cluster.post("/v1/completions", body, headers=session)
    assert status == 200, answer
    assert (headers["x-kvgate-engine"], headers["x-kvgate-route"]) == (holder.id, "session")


async def test_a_queue_at_its_limit_that_has_ended_since_does_not_refuse_requests(
    make_cluster: ClusterFactory,
) -> None:
    # Admission refuses an engine whose queue is at max_waiting_per_engine (256): it read the raw reading, so
    # requests of this gateway that had ended since the engine was read still made it refuse everything (503)
    # until the next reading.
    cluster = await make_cluster({"r": 1}, health_interval_s=3600.0)
    [engine] = cluster.gateway.fleet.engines.values()
    marks = [engine.report_lag.sent() for _ in range(256)]
    reading(engine, running=0, waiting=256, waiting_tokens=25_600)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
    assert (await cluster.post("/v1/completions", body))[0] == 503  # (they are still there)
    for mark in marks:
        engine.report_lag.request_ended(mark, 100)
    status, answer, _ = await cluster.post("/v1/completions", body)
    assert status == 200, answer
