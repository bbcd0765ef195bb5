"""build_metadata: the kernels' view of a step (slots, int32 tables and lengths) agrees with the block
tables, and a step that does not fit its blocks is refused."""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, SeqSlice, build_metadata

BLOCK = 4


def mixed_fields(meta: AttentionMetadata) -> tuple[object, ...] | None:
    """A mixed step's split, as lists; None for a pure decode or pure prefill step."""
    m = meta.mixed
    if m is None:
        return None
    tensors = (m.decode_rows, m.decode_tables, m.decode_seq_lens, m.prefill_seqs)
    return (*(t.tolist() for t in tensors), m.decode_max_context, m.prefill_max_query)


def test_kernel_fields_agree_with_the_block_tables() -> None:
    # a prompt, a chunk after a partial page, a decode token at a page boundary
    slices = [SeqSlice([7, 2, 5], 0, 9), SeqSlice([1, 6], 5, 2), SeqSlice([0, 3, 4, 8], 12, 1)]
    meta = build_metadata(slices, BLOCK)
    assert meta.query_lens == (9, 2, 1) and meta.context_lens == (9, 7, 13) and not meta.is_decode
    assert meta.query_start.tolist() == [0, 9, 11, 12] and meta.query_start.dtype == torch.int32
    assert meta.seq_lens.tolist() == [9, 7, 13] and meta.prefix_lens.tolist() == [0, 5, 12]
    assert meta.block_tables.tolist() == [[7, 2, 5, 0], [1, 6, 0, 0], [0, 3, 4, 8]]
    expected = [
        s.block_table[pos // BLOCK] * BLOCK + pos % BLOCK
        for s in slices
        for pos in range(s.num_computed, s.num_computed + s.num_new)
    ]
    assert meta.slot_mapping.tolist() == expected
    assert meta.slot_mapping.tolist()[-1] == 8 * BLOCK  # position 12: first slot of the fourth block
    # the decode row (sequence 2, row 11) goes to the decode kernel, the other two to the prefill kernel
    assert mixed_fields(meta) == ([11], [[0, 3, 4, 8]], [13], [0, 1], 13, 9)
    assert build_metadata([SeqSlice([3], 2, 1), SeqSlice([1], 0, 1)], BLOCK).is_decode


@pytest.mark.parametrize(
    ("slices", "message"),
    [
        ([], "at least one sequence"),
        ([SeqSlice([1], 0, 0)], "sequence 0: 0 new tokens"),
        ([SeqSlice([2], 0, 3), SeqSlice([1], 3, 2)], "sequence 1: 2 new tokens, 5 in context, 1 blocks"),
    ],
    ids=["empty", "no-new-token", "too-few-blocks"],
)
def test_a_step_that_does_not_fit_is_refused(slices: list[SeqSlice], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_metadata(slices, BLOCK)


def test_the_persistent_table_equals_the_rebuilt_one_through_admissions_growth_preemption_and_finishes() -> (
    None
):
    """Sequences admitted, grown a token at a time, preempted (blocks freed, admitted again with new ones),
    finished and replaced; each step some of them run. A small table (3 rows, 2 blocks) must grow and
    reuse rows, and every step's metadata equal ``build_metadata`` over copies of the block lists."""
    import random

    from engine.block_manager import BlockManager
    from engine.sequence import SamplingParams, Sequence
    from engine.step_metadata import StepMetadata

    rng = random.Random(0)
    blocks = BlockManager(64, BLOCK)
    persistent = StepMetadata(BLOCK, "cpu", max_num_seqs=3, max_blocks=2)
    waiting: list[Sequence] = []
    running: list[Sequence] = []
    made = mixed_steps = 0
    for step in range(300):
        if rng.random() < 0.3:
            made += 1
            length = rng.randint(1, 12)
            prompt = [rng.randrange(1000) for _ in range(length)]
            waiting.append(Sequence(f"r{made}", prompt, SamplingParams(), hash_seed=0))
        for seq in list(waiting):
            if blocks.can_allocate(seq):
                blocks.allocate(seq)
                waiting.remove(seq)
                running.append(seq)
            else:
                blocks.forget(seq)
        for seq in list(running):
            roll = rng.random()
            if roll < 0.04 or (roll < 0.1 and seq.num_tokens > 30):  # finished
                blocks.free(seq)
                running.remove(seq)
                if rng.random() < 0.5:
                    persistent.release(seq)  # optional: a full table reuses least recently used rows
            elif roll < 0.08:  # preempted: its blocks go, it is admitted again later
                blocks.free(seq)
                running.remove(seq)
                waiting.append(seq)
        batch = [seq for seq in running if rng.random() < 0.8]
        if not batch:
            continue
        items = []
        for seq in batch:
            if seq.num_computed == seq.num_tokens:  # decode: one token more, a block more at a boundary
                seq.token_ids.append(rng.randrange(1000))
                if not blocks.can_grow(seq, seq.num_tokens):
                    seq.token_ids.pop()
                    continue
                blocks.grow(seq, seq.num_tokens)
            items.append((seq, seq.block_table, seq.num_computed, seq.num_tokens - seq.num_computed))
        if not items:
            continue
        meta, ids, positions = persistent.build(items)
        rebuilt = build_metadata([SeqSlice(list(bt), c, n) for _, bt, c, n in items], BLOCK)
        assert ids is None
        assert meta.block_tables.tolist() == rebuilt.block_tables.tolist(), step
        for field in ("slot_mapping", "seq_lens", "query_start", "prefix_lens"):
            assert getattr(meta, field).tolist() == getattr(rebuilt, field).tolist(), (step, field)
        assert (meta.query_lens, meta.context_lens) == (rebuilt.query_lens, rebuilt.context_lens)
        assert mixed_fields(meta) == mixed_fields(rebuilt), step
        mixed_steps += meta.mixed is not None
        expected = [c + i for _, _, c, n in items for i in range(n)]
        assert positions.tolist() == expected
        for seq, table, _, _ in items:  # each row: the sequence's blocks, then zeros (padding reads block 0)
            row = persistent.rows[id(seq)][2]
            assert persistent.host[row].tolist() == table + [0] * (persistent.host.shape[1] - len(table))
        for seq, *_ in items:
            seq.num_computed = seq.num_tokens
    assert persistent.host.shape[0] > 3 and persistent.host.shape[1] > 2  # it had to grow
    assert made > 50 and mixed_steps > 20


def test_token_ids_come_with_the_metadata() -> None:
    import numpy as np

    from engine.step_metadata import StepMetadata

    owner_a, owner_b = object(), object()
    meta, ids, positions = StepMetadata(BLOCK).build(
        [(owner_a, [7, 2, 5], 0, 9), (owner_b, [1, 6], 5, 2)], np.arange(11, dtype=np.int64) + 100
    )
    assert ids is not None and ids.tolist() == list(range(100, 111))
    assert positions.tolist() == [*range(9), 5, 6]
    assert meta.block_tables.tolist() == [[7, 2, 5], [1, 6, 0]]
    # A mixed step: the split's arrays ride in the same staged copies as the ids
    meta, ids, _ = StepMetadata(BLOCK).build(
        [(owner_a, [7, 2, 5], 9, 1), (owner_b, [1, 6], 5, 2)], np.array([100, 101, 102], dtype=np.int64)
    )
    assert ids is not None and ids.tolist() == [100, 101, 102]
    assert meta.prefix_lens.tolist() == [9, 5]
    assert mixed_fields(meta) == ([0], [[7, 2, 5]], [10], [1], 10, 2)
