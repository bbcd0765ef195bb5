"""The trace reader and the discrete-event model, with a stand-in router (the real ones: tests/gateway)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from region_map.simulation.simulator import CostModel, LRUBlocks, SimEngine, simulate
from region_map.simulation.trace import TraceError, TraceRequest, load_trace


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_buckets_are_spread_and_conversations_named_by_their_first_private_block(tmp_path: Path) -> None:
    rows = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]},
        {"timestamp": 3000, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 100, "output_length": 5, "hash_ids": [0]},
    ]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert [r.arrival_s for r in trace] == [0.0, 1.5, 3.0, 3.5]
    assert [r.conversation for r in trace] == [1, 2, 1, 0]
    assert trace[2].blocks == (0, 1, 3)


@pytest.mark.parametrize("line", ['{"timestamp": 0}', "not json", '{"timestamp": 0, "input_length": 1, '
                                  '"output_length": 1, "hash_ids": []}'])  # fmt: skip
def test_bad_lines_name_the_file_and_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n' + line + "\n"
    )
    with pytest.raises(TraceError, match=r"bad\.jsonl:2"):
        load_trace(path)


def test_lru_blocks_evict_the_least_recently_used() -> None:
    lru = LRUBlocks(3)
    assert lru.insert([1, 2, 3]) == ([1, 2, 3], [])
    lru.insert([2])  # 2 is now the most recent
    assert lru.insert([4]) == ([4], [3])
    assert lru.prefix([2, 1, 4, 3]) == 3


def test_lru_blocks_evict_a_chains_tail_before_its_head_as_the_engines_do() -> None:
    """A prompt's blocks are a chain: an evicted head would leave its tail cached but unreachable."""
    lru = LRUBlocks(4)
    lru.insert([1, 2, 3])
    assert lru.insert([8, 9]) == ([8, 9], [3])
    assert lru.prefix([1, 2, 3]) == 2
    assert lru.insert([5, 6, 7, 8, 9]) == ([5, 6, 7], [2, 1, 9])  # a prompt over capacity keeps its head
    assert lru.prefix([5, 6, 7, 8, 9]) == 4


def test_an_engine_queues_prefills_and_finds_its_cache() -> None:
    changes: list[tuple[str, list[int], list[int]]] = []
    engine = SimEngine(
        "r/e0", "r", 10, CostModel(prefill_tokens_per_s=1000, block_tokens=100), lambda *a: changes.append(a)
    )
    first = TraceRequest(0.0, 500, 10, (1, 2, 3, 4, 5), 1)
    done, hit = engine.serve(0.0, first)
    assert (done, hit) == (0.5, 0) and changes == [("r/e0", [1, 2, 3, 4, 5], [])]
    second = TraceRequest(0.1, 600, 10, (1, 2, 3, 4, 5, 6), 1)
    done, hit = engine.serve(0.1, second)
    assert hit == 5 and done == pytest.approx(0.6)  # waits for the first prefill, then 100 uncached tokens
    assert engine.waiting(0.2) == 1 and engine.in_flight(0.2) == 2
    assert engine.queued_prefill_tokens(0.25) == 100 + 250  # the rest of the first, all of the second


def test_a_pull_moves_a_peers_prefix_instead_of_computing_it() -> None:
    cost = CostModel(prefill_tokens_per_s=1000, block_tokens=100, kv_pull_tokens_per_s=10_000)
    source = SimEngine("r/e0", "r", 10, cost, lambda *a: None)
    target = SimEngine("r/e1", "r", 10, cost, lambda *a: None)
    source.serve(0.0, TraceRequest(0.0, 400, 1, (1, 2, 3, 4), 1))
    source.cache.insert([9])  # something used after the conversation
    # 601 tokens: blocks 1-4 come from the peer (40 ms over the link), blocks 5-7 are computed here.
    done, hit = target.serve(1.0, TraceRequest(1.0, 601, 1, (1, 2, 3, 4, 5, 6, 7), 1), source)
    assert hit == 4 and done == pytest.approx(1.0 + 0.04 + 0.201)
    # The source's copy is now the first to go: the prefix moved rather than doubled.
    assert source.cache.insert(range(20, 30))[1] == [4, 3, 2, 1, 9]
    # The last prompt token is always computed where the request runs: a 400-token prompt pulls 3 blocks.
    again = SimEngine("r/e2", "r", 10, cost, lambda *a: None)
    assert again.serve(2.0, TraceRequest(2.0, 400, 1, (1, 2, 3, 4), 1), target)[1] == 3


def test_a_pull_gets_only_what_the_peer_has_computed_by_then() -> None:
    cost = CostModel(prefill_tokens_per_s=1000, block_tokens=100, kv_pull_tokens_per_s=10_000)
    source = SimEngine("r/e0", "r", 10, cost, lambda *a: None)
    source.serve(0.0, TraceRequest(0.0, 300, 1, (1, 2, 3), 1))  # computed by 0.3 s
    source.serve(0.0, TraceRequest(0.0, 500, 1, (1, 2, 3, 4, 5), 1))  # blocks 4-5 queued behind it: 0.5 s
    early = SimEngine("r/e1", "r", 10, cost, lambda *a: None)
    # At 0.4 s the first prompt's blocks exist, the second's new ones not yet: 3 pulled, 3 computed.
    assert early.serve(0.4, TraceRequest(0.4, 600, 1, (1, 2, 3, 4, 5, 6), 1), source)[1] == 3
    late = SimEngine("r/e2", "r", 10, cost, lambda *a: None)
    assert late.serve(0.5, TraceRequest(0.5, 600, 1, (1, 2, 3, 4, 5, 6), 1), source)[1] == 5


def test_a_prompt_longer_than_the_cache_leaves_no_record_of_the_blocks_it_evicted() -> None:
    cost = CostModel(prefill_tokens_per_s=1000, block_tokens=100)
    engine = SimEngine("r/e0", "r", 3, cost, lambda *a: None)
    for first in range(0, 50, 5):  # ten such prompts, none of whose first blocks stay
        engine.serve(first, TraceRequest(first, 500, 1, tuple(range(first, first + 5)), 1))
    assert len(engine.cache) == 3
    assert set(engine._ready_at) <= {b for b in range(50) if engine.cache.prefix([b])}  # bounded by the cache


def test_pulls_from_one_engine_share_its_link() -> None:
    cost = CostModel(prefill_tokens_per_s=1e9, block_tokens=100, kv_pull_tokens_per_s=10_000)
    source = SimEngine("r/e0", "r", 10, cost, lambda *a: None)
    source.cache.insert([1, 2, 3])
    first, second = (SimEngine(f"r/e{i}", "r", 10, cost, lambda *a: None) for i in (1, 2))
    request = TraceRequest(0.0, 350, 1, (1, 2, 3, 4), 1)
    assert first.serve(0.0, request, source)[0] == pytest.approx(0.03, abs=1e-6)
    assert second.serve(0.0, request, source)[0] == pytest.approx(0.06, abs=1e-6)  # waited for the first


class FirstEngine:
    def __init__(self) -> None:
        self.events: list[tuple[str, list[int], list[int]]] = []

    def route(
        self, request: TraceRequest, home: str, now: float, engines: Sequence[SimEngine]
    ) -> tuple[SimEngine, SimEngine | None]:
        return engines[0], None

    def kv_changed(self, engine_id: str, stored: list[int], evicted: list[int]) -> None:
        self.events.append((engine_id, stored, evicted))

    def first_token(self, n: int, at: float) -> None:
        pass


def test_the_replay_reports_hits_and_the_references() -> None:
    trace = [TraceRequest(float(i), 1024, 2, (0, 10 + i), 10 + i) for i in range(4)]
    trace.append(TraceRequest(9.0, 1024, 2, (0, 10), 10))
    router = FirstEngine()
    result = simulate(trace, regions=["a"], engines_per_region=2, capacity_blocks=100, router=router)
    # block 0 hits from the 2nd request on (3 hits); the last request repeats the first (2 hits).
    assert result.hit_rate == result.oracle_hit_rate == result.pooled_hit_rate == pytest.approx(5 / 10)
    assert result.load_max_over_mean == 2.0 and result.cross_region_share == 0.0
    assert router.events[0] == ("a/e0", [0, 10], [])
