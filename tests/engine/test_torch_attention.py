"""The torch (CPU) attention path: decode rows through grouped matmuls, prefill sequences through one SDPA
call each (causal by themselves when nothing of them was cached); every row equals the float32 reference."""

from __future__ import annotations

import pytest
import torch

from engine.attention import KVCache, SeqSlice, build_metadata, torch_attention
from engine.kernels import ops
from engine.kernels.attention_prefill import paged_prefill_attention_torch
from engine.step_metadata import StepMetadata
from tests.kernel_cases import randn

BLOCK = 8
HEADS, KV_HEADS, DIM = 4, 2, 16
STEPS = {
    # (tokens cached, new tokens) per sequence
    "mixed": [(36, 1), (13, 6), (4, 1), (0, 3)],
    "decode": [(36, 1), (4, 1), (0, 1), (15, 1)],
    "prefill": [(0, 9), (13, 6), (0, 2)],
}


def step(
    shape: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0
) -> tuple[list[SeqSlice], KVCache, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(done + new) // BLOCK) for done, new in shape]
    order = torch.randperm(sum(needed) + 2, generator=g).tolist()  # blocks scattered, two spare
    slices, used = [], 0
    for (done, new), n in zip(shape, needed, strict=True):
        slices.append(SeqSlice(order[used : used + n], done, new))
        used += n
    cache = KVCache(1, len(order), BLOCK, KV_HEADS, DIM, dtype)
    cache.k[0].copy_(randn(tuple(cache.k[0].shape), dtype, "cpu", g))  # cached prefixes: random
    cache.v[0].copy_(randn(tuple(cache.v[0].shape), dtype, "cpu", g))
    tokens = sum(new for _, new in shape)
    qkv = tuple(randn((tokens, h, DIM), dtype, "cpu", g) for h in (HEADS, KV_HEADS, KV_HEADS))
    return slices, cache, qkv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("persistent", [False, True], ids=["build_metadata", "StepMetadata"])
def test_every_row_equals_the_float32_reference(kind: str, dtype: torch.dtype, persistent: bool) -> None:
    slices, cache, (q, k, v) = step(STEPS[kind], dtype)
    if persistent:
        seqs = [(object(), list(s.block_table), s.num_computed, s.num_new) for s in slices]
        meta = StepMetadata(BLOCK, max_num_seqs=2, max_blocks=2).build(seqs)[0]  # grows to fit
    else:
        meta = build_metadata(slices, BLOCK)
    k_cache, v_cache = cache.layer(0)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    ours = torch_attention(q, k, v, k_cache, v_cache, meta, DIM**-0.5)
    f32 = [t.float() for t in (q, k, v, k_cache, v_cache)]
    expected = paged_prefill_attention_torch(
        *f32, meta.block_tables, meta.query_start, meta.prefix_lens, BLOCK, DIM**-0.5
    )
    assert ours.dtype == dtype and ours.shape == q.shape
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(ours.float(), expected, atol=tol, rtol=tol)


def test_the_plan_groups_decode_rows_and_masks_only_cached_prefixes() -> None:
    meta = build_metadata([SeqSlice([3, 1], 8, 1), SeqSlice([5, 2], 0, 9), SeqSlice([4, 6], 5, 3)], BLOCK)
    plan = meta.torch_plan
    assert plan.decode is not None and plan.decode.rows is not None and plan.decode.rows.tolist() == [0]
    assert plan.decode.slots.tolist() == [
        [3 * BLOCK + i for i in range(BLOCK)] + [BLOCK + i for i in range(BLOCK)]
    ]
    rows = plan.decode.cache_rows(2).tolist()  # [slots * 2 heads, D] rows: (sequence, head, key) order
    assert rows[:2] == [3 * BLOCK * 2, (3 * BLOCK + 1) * 2] and rows[16:18] == [
        3 * BLOCK * 2 + 1,
        (3 * BLOCK + 1) * 2 + 1,
    ]
    assert plan.decode.hidden[0, 0, 0].tolist() == [False] * 9 + [True] * 7  # context 9 of 16 keys
    fresh, cached = plan.prefill
    assert fresh.rows == slice(1, 10) and fresh.slots is None and fresh.mask is None  # SDPA's causal kernel
    assert cached.rows == slice(10, 13) and cached.slots is not None and cached.mask is not None
    assert cached.slots.tolist() == [4 * BLOCK + i for i in range(BLOCK)]  # 8 keys: all in block 4
    assert cached.mask.sum(-1).tolist() == [6, 7, 8]  # positions 5, 6, 7 see keys 0..position
    decode = build_metadata([SeqSlice([3], 2, 1), SeqSlice([1, 2], 8, 1)], BLOCK).torch_plan
    assert decode.decode is not None and decode.decode.rows is None and decode.prefill == ()
