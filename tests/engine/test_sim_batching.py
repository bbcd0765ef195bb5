"""The simulated engine's batching mode (``--profile``): one perfmodel step loop per engine, over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from engine.sim.batching_loop import BatchingLoop
from engine.sim.server import SimEngineConfig
from perfmodel.batching import step_time_s
from perfmodel.profiles import LLAMA3_8B_H100
from tests.engine.sim_nodes import Sim, StartSim, text_of, wait_for
from tests.engine.test_sim_cli import kvgate_parser

# Large per-token costs, scaled so that a test takes well under a second: a 200-token prefill is a 30 ms step.
FAST = "step_fixed_s=0.01,prefill_s_per_token=1e-4,decode_s_per_seq=1e-3,cached_read_s_per_token=1e-5"


async def start_batching(start_sim: StartSim, overrides: str = "", **fields: Any) -> Sim:
    text = f"{FAST},max_batch_tokens=256{',' + overrides if overrides else ''}"
    return await start_sim(profile="llama3-8b-h100", profile_overrides=text, **fields)


def loop_of(sim: Sim) -> BatchingLoop:
    assert sim.engine.batching is not None
    return sim.engine.batching


async def timed(coro: Any) -> tuple[float, Any]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    result = await coro
    return loop.time() - t0, result


async def test_concurrent_prompts_queue_fifo_behind_each_other(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim)
    alone, body = await timed(sim.complete({"prompt": text_of(200, "alone "), "max_tokens": 1}))
    assert body["usage"]["completion_tokens"] == 1
    assert alone >= 0.01 + 200 * 1e-4 - 1e-3  # one step: fixed + 200 prefill tokens

    n = 4
    latencies_bodies = await asyncio.gather(
        *(timed(sim.complete({"prompt": text_of(200, f"p{i} "), "max_tokens": 1})) for i in range(n))
    )
    latencies = sorted(t for t, _ in latencies_bodies)
    # 800 prefill tokens through a 256-token budget: the last one waits for about 4 steps' worth of work.
    assert latencies[-1] > 2.5 * alone, (alone, latencies)
    assert latencies[-1] >= 0.01 * 4 + 800 * 1e-4 - 1e-3
    steps = [s.record for s in loop_of(sim).steps][1:]  # those of the 4 concurrent requests
    admitted = [key for r in steps for key in r.admitted]
    first_tokens = [key for r in steps for key in r.first_tokens]
    assert len(admitted) == n and first_tokens == admitted  # FIFO: no request overtakes an earlier one
    assert all(r.prefill_tokens <= 256 for r in steps)
    assert sum(r.prefill_tokens for r in steps) == 800


async def test_step_times_are_the_models(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim)
    batching = loop_of(sim)
    profile = batching.profile
    assert profile.step_fixed_s == 0.01 and profile.max_batch_tokens == 256
    prompt = text_of(100, "same ")
    elapsed, body = await timed(sim.complete({"prompt": prompt, "max_tokens": 3}))
    assert body["usage"]["completion_tokens"] == 3
    # Again: 96 tokens (6 whole blocks; the last token is always computed) come from the prefix cache.
    elapsed2, body2 = await timed(sim.complete({"prompt": prompt, "max_tokens": 2}))
    assert body2["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    records = [s.record for s in batching.steps]
    batches = [(r.prefill_tokens, r.decode_seqs, r.cached_tokens_read) for r in records]
    assert batches == [(100, 0, 0), (0, 1, 0), (0, 1, 0), (4, 0, 96), (0, 1, 0)]
    for r in records:
        assert r.duration_s == step_time_s(profile, r.prefill_tokens, r.decode_seqs, r.cached_tokens_read)
        assert r.end_s - r.start_s == pytest.approx(r.duration_s)
    for s in batching.steps:  # executed on the loop's clock when it ended, not before
        assert s.record.end_s - 1e-3 <= s.executed_at_s < s.record.end_s + 0.05
    assert batching.steps_total == 5
    assert elapsed >= sum(r.duration_s for r in records[:3]) - 2e-3
    assert elapsed2 >= sum(r.duration_s for r in records[3:]) - 2e-3
    assert elapsed2 < elapsed  # the cached prefix was not prefilled again


async def test_streams_get_a_token_per_decode_step(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim)
    requests = [{"prompt": text_of(50, f"s{i} "), "max_tokens": 6, "seed": i} for i in range(2)]
    events = await asyncio.gather(*(sim.stream("/v1/completions", r) for r in requests))
    plain = await sim.complete(requests[0])
    for evs in events:
        assert evs[-1] == "[DONE]"
        assert sum(1 for e in evs[:-2] if e["choices"][0]["text"]) == 6
    assert "".join(e["choices"][0]["text"] for e in events[0][:-1]) == plain["choices"][0]["text"]
    records = [s.record for s in loop_of(sim).steps]
    assert max(r.decode_seqs for r in records) == 2  # the two streams decoded in the same steps


async def test_health_reports_the_queue(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim, "max_running=1")
    load = (await sim.health())["load"]
    assert (load["running"], load["waiting"], load["waiting_tokens"], load["max_running"]) == (0, 0, 0, 1)
    # The KV blocks are the model's: what running requests hold of its KV capacity (admission waits on it).
    total = loop_of(sim).profile.kv_capacity_tokens // sim.engine.config.block_size
    assert (load["kv_blocks_used"], load["kv_blocks_free"], load["kv_blocks_total"]) == (0, total, total)
    tasks = [
        asyncio.create_task(sim.complete({"prompt": text_of(40, f"q{i} "), "max_tokens": 20}))
        for i in range(3)
    ]

    async def queued() -> bool:
        load = (await sim.health())["load"]
        return bool(load["waiting"] == 2)

    await wait_for(queued)
    load = (await sim.health())["load"]
    assert load["running"] == 1 and load["waiting"] == 2
    assert load["waiting_tokens"] >= 2 * 40  # the queued prompts' prefill is still to do
    # The running one holds its prompt's and its answer's KV (40 + 20 tokens: 4 blocks of 16), no more.
    assert load["kv_blocks_used"] == 4 and load["kv_blocks_free"] == total - 4
    metrics = await (await sim.session.get(f"{sim.url}/metrics")).text()
    assert 'state="waiting"' in metrics
    bodies = await asyncio.gather(*tasks)
    assert [b["usage"]["completion_tokens"] for b in bodies] == [20, 20, 20]
    load = (await sim.health())["load"]
    assert (load["running"], load["waiting"], load["waiting_tokens"]) == (0, 0, 0)
    # Blocks the prefix cache keeps but no request holds are free to take, as a real engine's evictable ones.
    assert sim.engine.cache.used > 0 and (load["kv_blocks_used"], load["kv_blocks_free"]) == (0, total)


async def test_a_request_too_big_for_the_kv_cache_is_refused(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim, "kv_capacity_tokens=64")
    status, body, _ = await sim.post("/v1/completions", {"prompt": text_of(100), "max_tokens": 4})
    assert status == 400 and "KV" in body["error"]["message"]
    assert (await sim.complete({"prompt": text_of(20), "max_tokens": 4}))["usage"]["completion_tokens"] == 4


async def test_without_a_profile_requests_are_costed_on_their_own(start_sim: StartSim) -> None:
    # 0.4 s of prefill each: queued one behind another, four would take 1.6 s; on their own they overlap,
    # and the 0.4 s margin below absorbs a loaded machine's scheduling delays.
    sim = await start_sim(prefill_s_per_token=4e-3, max_running=8)
    assert sim.engine.batching is None
    n, one = 4, 100 * 4e-3
    total, results = await timed(
        asyncio.gather(
            *(timed(sim.complete({"prompt": text_of(100, f"o{i} "), "max_tokens": 1})) for i in range(n))
        )
    )
    for latency, _ in results:
        assert latency >= one - 2e-3  # each pays its own prefill ...
    assert total < 2 * one  # ... at the same time as the others: no queueing
    assert (await sim.health())["load"]["max_running"] == 8


def test_cli_profile_flags() -> None:
    args = kvgate_parser().parse_args(["sim-engine", "--port", "1"])
    assert (args.profile, args.profile_overrides) == (None, "")
    args = kvgate_parser().parse_args(
        ["sim-engine", "--port", "1", "--profile", "llama3-8b-h100", "--profile-overrides", "max_running=8"]
    )
    assert (args.profile, args.profile_overrides) == ("llama3-8b-h100", "max_running=8")


def test_config_resolves_and_checks_the_profile() -> None:
    assert SimEngineConfig(engine_id="e").engine_profile() is None
    cfg = SimEngineConfig(engine_id="e", profile="llama3-8b-h100", profile_overrides="max_batch_tokens=512")
    profile = cfg.engine_profile()
    assert profile is not None and profile.max_batch_tokens == 512
    assert profile.step_fixed_s == LLAMA3_8B_H100.step_fixed_s
    with pytest.raises(ValueError, match="unknown engine profile"):
        SimEngineConfig(engine_id="e", profile="nope")
    with pytest.raises(ValueError, match="unknown EngineProfile field"):
        SimEngineConfig(engine_id="e", profile="llama3-8b-h100", profile_overrides="bogus=1")
    with pytest.raises(ValueError, match="needs a profile"):
        SimEngineConfig(engine_id="e", profile_overrides="max_running=2")


@pytest.mark.parametrize(
    "override", ["step_fixed_s=nan", "step_fixed_s=inf", "decode_s_per_seq=nan", "max_running=inf"]
)
def test_a_cost_that_is_no_finite_number_is_refused_with_its_field(override: str) -> None:
    # A NaN step time slept no time at all and an infinite one held every request forever; an infinite
    # integer field ended the command in an OverflowError's traceback.
    field = override.partition("=")[0]
    with pytest.raises(ValueError, match=f"EngineProfile.{field} must be a finite number"):
        SimEngineConfig(engine_id="e", profile="llama3-8b-h100", profile_overrides=override)


@pytest.mark.parametrize("field", ["prefill_s_per_token", "decode_s_per_token", "kv_pull_s_per_token"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_per_request_costs_must_be_finite(field: str, value: float) -> None:
    with pytest.raises(ValueError, match="costs must be finite numbers >= 0"):
        SimEngineConfig(engine_id="e", **{field: value})


async def test_a_stream_whose_client_leaves_stops_costing_the_engine_steps(start_sim: StartSim) -> None:
    sim = await start_batching(start_sim)
    batching = loop_of(sim)
    prompt = text_of(50, "gone ")
    body = {"model": sim.engine.config.model, "prompt": prompt, "max_tokens": 400, "stream": True}
    async with sim.session.post(f"{sim.url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # its first token is out: it decodes now
        assert batching.running == 1
    # The connection closed with ~398 tokens to go: the model stops decoding it within a few steps.

    async def idle() -> bool:
        return batching.running == 0 and batching.engine.idle()

    await wait_for(idle)
    steps = batching.steps_total
    await asyncio.sleep(0.05)
    assert batching.steps_total == steps  # no step runs for nobody


async def test_a_prompt_queued_behind_its_prefix_reuses_it(start_sim: StartSim) -> None:
    """As vLLM and SGLang match a waiting prompt's prefix when they schedule it, not when it arrives: a
    follow-up sent while an earlier prompt with the same start is still in its prefill queues behind it
    (FIFO) and finds those blocks computed by then."""
    sim = await start_batching(start_sim)
    first = text_of(2000, "shared ")  # 8 chunks of the 256-token budget: ~0.3 s of prefill
    earlier = asyncio.create_task(sim.complete({"prompt": first, "max_tokens": 1}))

    async def started() -> bool:
        return loop_of(sim).steps_total >= 1  # its prefill is under way, far from done

    await wait_for(started)
    later = await sim.complete({"prompt": first + " and then more", "max_tokens": 1})
    body = await earlier
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] == 2000  # every whole block of it
    steps = [s.record for s in loop_of(sim).steps]
    assert sum(r.prefill_tokens for r in steps) == 2000 + len(" and then more")  # computed once
    first_tokens = [key for r in steps for key in r.first_tokens]
    assert len(first_tokens) == 2 and first_tokens == sorted(first_tokens, key=lambda k: int(k[1:]))


async def test_a_prompt_whose_client_left_before_its_prefill_leaves_no_blocks(start_sim: StartSim) -> None:
    """Its blocks were cached when it queued; never computed, they must not serve a later prompt."""
    sim = await start_batching(start_sim)
    prompt = text_of(2000, "abandoned ")
    body = {"model": sim.engine.config.model, "prompt": prompt, "max_tokens": 5, "stream": True}
    before = sim.engine.cache.used
    task = asyncio.create_task(sim.session.post(f"{sim.url}/v1/completions", json=body))

    async def queued() -> bool:
        return sim.engine.cache.used > before  # its blocks are in

    await wait_for(queued)
    task.cancel()  # the client goes away before its first token
    with contextlib.suppress(asyncio.CancelledError):
        await task

    async def gone() -> bool:
        return sim.engine.cache.used == before and loop_of(sim).engine.idle()

    await wait_for(gone)
    again = await sim.complete({"prompt": prompt, "max_tokens": 1})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_pull_gets_no_blocks_of_a_prompt_still_in_its_prefill(start_sim: StartSim) -> None:
    """Blocks cached when their prompt queued serve the prompts queued behind it here, but their K/V does not
    exist yet: a peer pulling them gets nothing until the prefill has run, then all of them."""
    source = await start_batching(start_sim, engine_id="src")
    target = await start_sim(engine_id="dst")
    prompt = text_of(2000, "pulled ")  # 8 chunks of the 256-token budget: ~0.3 s of prefill
    earlier = asyncio.create_task(source.complete({"prompt": prompt, "max_tokens": 1}))

    async def started() -> bool:
        return loop_of(source).steps_total >= 1  # its prefill is under way, far from done

    await wait_for(started)
    pull = {"pull_url": source.url, "pull_engine": "src", "pull_tokens": 1984}
    early = await target.complete({"prompt": prompt + "!", "max_tokens": 1, "kv_transfer_params": pull})
    assert early["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert source.engine.counters.kv_pull_served_tokens == 0
    await earlier
    other = await start_sim(engine_id="dst2")  # (the first target has computed the prompt by now)
    late = await other.complete({"prompt": prompt + "?", "max_tokens": 1, "kv_transfer_params": pull})
    assert late["usage"]["prompt_tokens_details"]["cached_tokens"] == 1984
    assert source.engine.counters.kv_pull_served_tokens == 1984
