"""The replay's opt-in batching mode: every engine is perfmodel's BatchingEngine, the simulated engine's."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence

import pytest

from perfmodel.batching import BatchingEngine, StepRecord, step_time_s
from perfmodel.profiles import profile, with_overrides
from region_map.simulation.batched import BatchedSimEngine
from region_map.simulation.simulator import CostModel, LRUBlocks, SimEngine, percentile, simulate
from region_map.simulation.trace import TraceRequest

PROFILE = with_overrides(profile("llama3-8b-h100"), max_batch_tokens=2048, cached_read_s_per_token=1e-6)


class Rotate:
    """A stand-in router: engines in turn, never a pull."""

    def __init__(self) -> None:
        self.n = 0

    def route(
        self, request: TraceRequest, home: str, now: float, engines: Sequence[SimEngine]
    ) -> tuple[SimEngine, SimEngine | None]:
        self.n += 1
        return engines[self.n % len(engines)], None

    def kv_changed(self, engine_id: str, stored: list[int], evicted: list[int]) -> None:
        pass

    def first_token(self, n: int, at: float) -> None:
        pass


def workload(n: int = 120) -> list[TraceRequest]:
    """Conversations of growing prompts arriving faster than one engine prefills them, so batches mix
    prefill chunks, decodes and cached reads."""
    trace = []
    for i in range(n):
        conversation, turn = i % 10, i // 10
        blocks = tuple(1000 * conversation + j for j in range(turn + 2))
        trace.append(TraceRequest(0.02 * i, 512 * len(blocks) - 37, 5 + i % 7, blocks, conversation))
    return trace


def test_every_step_lasts_the_shared_step_time_of_its_batch() -> None:
    steps: dict[str, list[StepRecord]] = defaultdict(list)

    def record(engine: str, step: StepRecord) -> None:
        steps[engine].append(step)

    result = simulate(workload(), regions=["a"], engines_per_region=2, capacity_blocks=50, router=Rotate(),
                      profile=PROFILE, on_step=record)  # fmt: skip
    assert set(steps) == {"a/e0", "a/e1"} and result.requests == 120
    for records in steps.values():
        assert any(r.prefill_tokens and r.decode_seqs and r.cached_tokens_read for r in records)
        for previous, following in itertools.pairwise(records):
            assert following.start_s >= previous.end_s  # one batch at a time
        for r in records:
            assert r.duration_s == step_time_s(PROFILE, r.prefill_tokens, r.decode_seqs, r.cached_tokens_read)
            assert r.end_s == pytest.approx(r.start_s + r.duration_s)
            assert r.prefill_tokens <= PROFILE.max_batch_tokens
    assert sum(len(r.finished) for records in steps.values() for r in records) == 120


def test_one_engine_replays_exactly_as_a_lone_batching_engine() -> None:
    """The replay adds nothing to the model: one engine fed the trace with its LRU hits as cached tokens
    gives the same first tokens as a BatchingEngine run by hand."""
    trace = workload()
    result = simulate(trace, regions=["a"], engines_per_region=1, capacity_blocks=30, router=Rotate(),
                      profile=PROFILE)  # fmt: skip
    lru, engine = LRUBlocks(30), BatchingEngine(PROFILE)
    for n, r in enumerate(trace):
        cached = min(lru.prefix(r.blocks) * 512, r.input_tokens)
        lru.insert(r.blocks)
        engine.run_until(r.arrival_s)
        engine.submit(str(n), r.arrival_s, r.input_tokens, cached, r.output_tokens)
    engine.run_to_completion()
    ttfts = [engine.result(str(n)).first_token_s - r.arrival_s for n, r in enumerate(trace)]  # type: ignore[operator]
    assert (result.ttft_p50_s, result.ttft_p90_s, result.ttft_p99_s) == tuple(
        percentile(ttfts, q) for q in (0.50, 0.90, 0.99)
    )


def test_the_load_a_router_reads_is_the_models() -> None:
    cost = CostModel(block_tokens=100)
    sim = BatchedSimEngine(
        "r/e0", "r", 10, cost, lambda *a: None, with_overrides(PROFILE, max_batch_tokens=64)
    )
    sim.submit("a", 0.0, TraceRequest(0.0, 1000, 3, (1, 2, 3), 1))
    sim.submit("b", 0.0, TraceRequest(0.0, 300, 3, (7, 8, 9), 2))
    sim.advance(0.0)  # nothing has run yet
    assert (sim.in_flight(0.0), sim.waiting(0.0), sim.queued_prefill_tokens(0.0)) == (2, 2, 1300)
    sim.advance(3 * step_time_s(sim.batching.profile, 64, 0))  # three 64-token chunks of "a"
    assert (sim.in_flight(1.0), sim.waiting(1.0), sim.queued_prefill_tokens(1.0)) == (2, 1, 1300 - 192)
    with pytest.raises(TypeError, match="submit"):
        sim.serve(1.0, TraceRequest(1.0, 10, 1, (4,), 3))


def test_a_pulled_prefix_is_cached_and_the_prefill_starts_when_it_has_arrived() -> None:
    cost = CostModel(block_tokens=100, kv_pull_tokens_per_s=10_000)
    source = BatchedSimEngine("r/e0", "r", 10, cost, lambda *a: None, PROFILE)
    target = BatchedSimEngine("r/e1", "r", 10, cost, lambda *a: None, PROFILE)
    source.cache.insert([1, 2, 3, 4])
    # 601 tokens: blocks 1-4 come from the peer (40 ms over the link), 201 tokens are computed here.
    assert target.submit("pulled", 1.0, TraceRequest(1.0, 601, 2, (1, 2, 3, 4, 5, 6, 7), 1), source) == 4
    # Arriving later but before the pull is done: queued behind it (FIFO), never an error.
    assert target.submit("next", 1.01, TraceRequest(1.01, 50, 2, (9,), 2)) == 0
    target.finish()
    pulled, after = target.batching.result("pulled"), target.batching.result("next")
    assert pulled.arrival_s == pytest.approx(1.04) and after.arrival_s == pulled.arrival_s
    first = step_time_s(PROFILE, 201 + 50, 0, 400)  # one step: both prefills, the pulled prefix read once
    assert target.first_token_s("pulled") == pytest.approx(1.04 + first)


def test_a_pull_gets_no_blocks_of_a_prompt_whose_prefill_has_not_run() -> None:
    """Stored at admission for the prompts queued behind it, but a peer can pull only computed K/V."""
    cost = CostModel(block_tokens=100, kv_pull_tokens_per_s=10_000)
    source = BatchedSimEngine("r/e0", "r", 10, cost, lambda *a: None, PROFILE)
    source.submit("long", 0.0, TraceRequest(0.0, 400, 1, (1, 2, 3, 4), 1))
    early = BatchedSimEngine("r/e1", "r", 10, cost, lambda *a: None, PROFILE)
    request = TraceRequest(0.0, 601, 1, (1, 2, 3, 4, 5, 6, 7), 1)
    assert early.submit("early", 0.0, request, source) == 0  # its prefill has not run
    source.finish()
    late = BatchedSimEngine("r/e2", "r", 10, cost, lambda *a: None, PROFILE)
    assert late.submit("late", source.first_token_s("long"), request, source) == 4
