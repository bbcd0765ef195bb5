"""build_metadata: the kernels' view of a step (slots, int32 tables and lengths) agrees with the torch
path's padded layout, and a step that does not fit its blocks is refused."""

from __future__ import annotations

import pytest
import torch

from engine.attention import SeqSlice, build_metadata

BLOCK = 4


def test_kernel_fields_agree_with_the_dense_layout() -> None:
    # a prompt, a chunk after a partial page, a decode token at a page boundary
    slices = [SeqSlice([7, 2, 5], 0, 9), SeqSlice([1, 6], 5, 2), SeqSlice([0, 3, 4, 8], 12, 1)]
    meta = build_metadata(slices, BLOCK)
    assert meta.query_lens == (9, 2, 1) and meta.context_lens == (9, 7, 13) and not meta.is_decode
    assert meta.query_start.tolist() == [0, 9, 11, 12] and meta.query_start.dtype == torch.int32
    assert meta.seq_lens.tolist() == [9, 7, 13] and meta.prefix_lens.tolist() == [0, 5, 12]
    assert meta.block_tables.tolist() == [[7, 2, 5, 0], [1, 6, 0, 0], [0, 3, 4, 8]]
    expected = [
        int(meta.dense.key_slots[b, pos])
        for b, s in enumerate(slices)
        for pos in range(s.num_computed, s.num_computed + s.num_new)
    ]
    assert meta.slot_mapping.tolist() == expected
    assert meta.slot_mapping.tolist()[-1] == 8 * BLOCK  # position 12: first slot of the fourth block
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
