"""Continuous batching without a model: chunked prefill, admission, preemption and recompute."""

from __future__ import annotations

from cache.hashing import namespace_seed
from engine.block_manager import BlockManager
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import SamplingParams, SeqStatus, Sequence

BS = 4


def make(rid: str, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(
        rid,
        [hash((rid, i)) % 1000 for i in range(n)],
        SamplingParams(max_tokens=max_tokens),
        namespace_seed("m"),
    )


def step(sched: Scheduler) -> list[ScheduledSeq]:
    """One engine step with a stand-in model: the 'next token' is a function of the position."""
    batch = sched.schedule()
    for item in batch:
        seq = item.seq
        samples = item.samples
        seq.num_computed += item.num_new
        sched.blocks.register_full_blocks(seq)
        if samples:
            seq.token_ids.append(seq.num_tokens * 7 % 1000)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, "length")
    return batch


def test_a_long_prompt_is_prefilled_in_chunks_under_the_budget() -> None:
    sched = Scheduler(BlockManager(64, BS), max_num_batched_tokens=8)
    sched.add(make("a", 20))
    chunks = [[(i.seq.request_id, i.num_new, i.samples) for i in step(sched)] for _ in range(4)]
    assert chunks == [[("a", 8, False)], [("a", 8, False)], [("a", 4, True)], [("a", 1, True)]]


def test_running_sequences_go_first_and_newcomers_fill_the_rest() -> None:
    sched = Scheduler(BlockManager(64, BS), max_num_batched_tokens=10)
    sched.add(make("a", 6, max_tokens=10))
    step(sched)  # a prefilled
    sched.add(make("b", 30))
    batch = step(sched)
    assert [(i.seq.request_id, i.num_new) for i in batch] == [("a", 1), ("b", 9)]
    assert sum(i.num_new for i in batch) <= 10


def test_max_num_seqs_is_respected() -> None:
    sched = Scheduler(BlockManager(64, BS), max_num_seqs=2)
    for rid in "abc":
        sched.add(make(rid, 3))
    step(sched)
    assert [s.request_id for s in sched.running] == ["a", "b"] and len(sched.waiting) == 1


def test_preemption_recomputes_and_every_sequence_completes() -> None:
    # 6 blocks of 4: two 7-token prompts take 2 blocks each; decoding 8 tokens each needs 4 blocks each.
    bm = BlockManager(6, BS)
    sched = Scheduler(bm, max_num_batched_tokens=64)
    a, b = make("a", 7, max_tokens=8), make("b", 7, max_tokens=8)
    sched.add(a)
    sched.add(b)
    for _ in range(100):
        if not sched.has_work():
            break
        step(sched)
    assert a.status is SeqStatus.FINISHED and b.status is SeqStatus.FINISHED
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert sched.preemptions >= 1
    # The stand-in model's tokens depend only on positions: recomputed, a sequence ends as if undisturbed.
    assert a.output_token_ids == [(7 + i) * 7 % 1000 for i in range(8)]
    assert bm.num_free == 6


def test_a_preempted_sequence_finds_its_blocks_in_the_prefix_cache() -> None:
    bm = BlockManager(5, BS)
    sched = Scheduler(bm, max_num_batched_tokens=64)
    a, b = make("a", 8, max_tokens=8), make("b", 8, max_tokens=8)
    sched.add(a)
    sched.add(b)
    recomputed: list[int] = []
    for _ in range(100):
        if not sched.has_work():
            break
        for item in step(sched):
            if item.seq is b and item.num_new > 1:
                recomputed.append(item.seq.num_computed - item.num_new)
    assert sched.preemptions >= 1
    assert any(start > 0 for start in recomputed[1:]), "re-admission should skip its cached blocks"


def test_finishing_releases_blocks() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(bm)
    s = make("a", 5, max_tokens=1)
    sched.add(s)
    step(sched)
    assert s.status is SeqStatus.FINISHED and s.finish_reason == "length"
    assert bm.num_free == 8 and not sched.running
