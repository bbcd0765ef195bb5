"""Attention over the paged KV cache: Triton kernels where ``engine.kernels.ops`` picks them (CUDA), one
batched torch SDPA call elsewhere.

A step's tokens arrive flattened: T new tokens from B sequences, each sequence with some tokens already in
the cache (a cached prefix, earlier prefill chunks, earlier decode steps). ``AttentionMetadata`` says, once
per step, where each new token's K/V goes (``slot_mapping``) and which cache slots each sequence reads
(``block_tables``; the torch path's padded ``dense`` layout is built from them on first use); every layer
then stores and attends.

``engine.step_metadata.StepMetadata`` builds the same metadata from persistent state (a block table row
per running sequence, pinned staging on CUDA); ``build_metadata`` rebuilds it from Python lists each step
(the pipeline-parallel path still uses it).

A mixed step (decode rows, query length 1, beside prefill chunks) is split by ``MixedSplit``: the decode
rows go through the decode kernel, which reads each KV head's K/V once for its whole query-head group and
splits long contexts, where the prefill kernel would read it once per query head and never split; only
the prefill rows go through the prefill kernel. Both paths' indices are built with the rest of the step's
metadata, once, not per layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels import ops


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: its block table, tokens already cached, tokens computed now."""

    block_table: Sequence[int]
    num_computed: int
    num_new: int


@dataclass(frozen=True)
class DenseLayout:
    """The step as one padded batch, for the torch path's single SDPA call."""

    key_slots: torch.Tensor  # [B, Lk] long: cache slot of each key position (padding reads slot 0)
    query_rows: torch.Tensor  # [B, Lq] long: flat row of each (padded) query
    query_valid: torch.Tensor  # [B, Lq] bool
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool: True where a query may attend a key


@dataclass(frozen=True)
class MixedSplit:
    """A step with both decode rows and prefill rows: what each kernel path needs for its own rows."""

    decode_rows: torch.Tensor  # [Bd] long: flat row of each decode sequence's one token
    decode_tables: torch.Tensor  # [Bd, max_blocks]: their block table rows
    decode_seq_lens: torch.Tensor  # [Bd] int32: their context lengths, this token included
    decode_max_context: int  # on the host: sizes the decode split without a device sync
    prefill_seqs: torch.Tensor  # [Bp] long: the step's other sequences (indices into query_start ...)
    prefill_max_query: int  # their longest chunk, on the host


@dataclass(frozen=True)
class AttentionMetadata:
    slices: tuple[SeqSlice, ...]
    device: torch.device
    block_size: int
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # keys each sequence attends to, this step's tokens included
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    # The same step as the Triton kernels read it (int32, nothing padded to [Lq, Lk])
    block_tables: torch.Tensor  # [B, max_blocks]: padding reads block 0
    seq_lens: torch.Tensor  # [B]: context_lens on the device
    query_start: torch.Tensor  # [B + 1]: sequence b's rows are query_start[b]:query_start[b + 1]
    prefix_lens: torch.Tensor  # [B]: tokens of each sequence in the cache before this step
    mixed: MixedSplit | None = None  # set when the step has decode rows and prefill rows

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode(self) -> bool:
        """Every sequence computes one token: the paged decode kernel serves the step."""
        return all(n == 1 for n in self.query_lens)

    @cached_property
    def dense(self) -> DenseLayout:
        """Built on first use, by the torch path only: its [B, 1, Lq, Lk] mask costs the host O(B·Lq·Lk)
        (346 ms for one 8k-token prompt, 1.5 s for 256 sequences of 4k measured on 2 CPU cores)."""
        return _dense_layout(self.slices, self.block_size, self.device)


def build_metadata(
    slices: Sequence[SeqSlice], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    if not slices:
        raise ValueError("a step needs at least one sequence")
    count = len(slices)
    num_new = np.fromiter((s.num_new for s in slices), dtype=np.int64, count=count)
    num_computed = np.fromiter((s.num_computed for s in slices), dtype=np.int64, count=count)
    num_blocks = np.fromiter((len(s.block_table) for s in slices), dtype=np.int64, count=count)
    ctx = num_computed + num_new
    check_step(num_new, ctx, num_blocks, block_size)
    tables = np.zeros((count, int(num_blocks.max())), dtype=np.int32)
    for b, s in enumerate(slices):
        tables[b, : len(s.block_table)] = s.block_table
    # Every new token at once: its sequence, its position there, the slot the block table gives it
    starts = np.concatenate(([0], np.cumsum(num_new)))
    seq = np.repeat(np.arange(count), num_new)
    pos = np.arange(starts[-1]) - starts[seq] + num_computed[seq]
    slots = tables[seq, pos // block_size].astype(np.int64) * block_size + pos % block_size
    device = torch.device(device)
    mixed = None
    split = split_rows(num_new)
    if split is not None:
        dec, pre = split
        mixed = MixedSplit(
            decode_rows=torch.from_numpy(starts[dec]).to(device),
            decode_tables=torch.from_numpy(tables[dec]).to(device),
            decode_seq_lens=_int32(ctx[dec], device),
            decode_max_context=int(ctx[dec].max()),
            prefill_seqs=torch.from_numpy(pre).to(device),
            prefill_max_query=int(num_new[pre].max()),
        )
    return AttentionMetadata(
        slices=tuple(slices),
        device=device,
        block_size=block_size,
        query_lens=tuple(num_new.tolist()),
        context_lens=tuple(ctx.tolist()),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=_int32(ctx, device),
        query_start=_int32(starts, device),
        prefix_lens=_int32(num_computed, device),
        mixed=mixed,
    )


def check_step(num_new: np.ndarray, ctx: np.ndarray, num_blocks: np.ndarray, block_size: int) -> None:
    bad = np.flatnonzero((num_new < 1) | (num_blocks * block_size < ctx))
    if bad.size:
        b = int(bad[0])
        blocks = num_blocks[b]
        raise ValueError(f"sequence {b}: {num_new[b]} new tokens, {ctx[b]} in context, {blocks} blocks")


def split_rows(num_new: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(decode sequences, prefill sequences) of a mixed step, by index; None unless both kinds are there."""
    one = num_new == 1
    if one.all() or not one.any():
        return None
    return np.flatnonzero(one), np.flatnonzero(~one)


def _int32(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int32)).to(device)


def _dense_layout(slices: Sequence[SeqSlice], block_size: int, device: torch.device) -> DenseLayout:
    q_max = max(s.num_new for s in slices)
    k_max = max(s.num_computed + s.num_new for s in slices)
    key_slots = torch.zeros(len(slices), k_max, dtype=torch.long)
    query_rows = torch.zeros(len(slices), q_max, dtype=torch.long)
    query_valid = torch.zeros(len(slices), q_max, dtype=torch.bool)
    mask = torch.zeros(len(slices), 1, q_max, k_max, dtype=torch.bool)
    row = 0
    for b, s in enumerate(slices):
        ctx = s.num_computed + s.num_new
        table = torch.as_tensor(list(s.block_table), dtype=torch.long)
        positions = torch.arange(ctx, dtype=torch.long)
        key_slots[b, :ctx] = table[positions // block_size] * block_size + positions % block_size
        query_rows[b, : s.num_new] = torch.arange(row, row + s.num_new)
        query_valid[b, : s.num_new] = True
        # Query i sits at position num_computed + i and sees keys 0..that position (causal).
        q_pos = torch.arange(s.num_computed, ctx).unsqueeze(1)
        mask[b, 0, : s.num_new, :ctx] = positions.unsqueeze(0) <= q_pos
        mask[b, 0, s.num_new :, 0] = True  # padding rows attend somewhere: an all-False row gives NaN
        row += s.num_new
    return DenseLayout(key_slots.to(device), query_rows.to(device), query_valid.to(device), mask.to(device))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,  # [slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Store this step's K/V in the cache, then attend each query to its sequence's cached context."""
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if _use_kernels(q):
        return kernel_attention(q, k, v, k_cache, v_cache, meta, scale)
    dense = meta.dense
    keys = k_cache[dense.key_slots].transpose(1, 2).to(q.dtype)  # [B, Hkv, Lk, D]
    values = v_cache[dense.key_slots].transpose(1, 2).to(q.dtype)
    queries = q[dense.query_rows].transpose(1, 2)  # [B, Hq, Lq, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=dense.mask, scale=scale, enable_gqa=queries.shape[1] != keys.shape[1]
    )
    return out.transpose(1, 2)[dense.query_valid]  # [T, Hq, D], flat order


def _use_kernels(q: torch.Tensor) -> bool:
    """The kernel path (``kernel_attention``) where Triton runs; one padded SDPA call elsewhere."""
    return ops.use_triton(q)


def kernel_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]: this step's K/V, already stored in the cache
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention through ``ops``' paged kernels (Triton, or their torch references off CUDA): a decode step
    through the decode kernel, a prefill step through the prefill kernel, a mixed step split between them."""
    block = meta.block_size
    if meta.is_decode:
        longest = max(meta.context_lens)  # known on the host: no device sync to size the split
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, block, scale, longest
        )
    mixed = meta.mixed
    args = (q, k, v, k_cache, v_cache, meta.block_tables, meta.query_start, meta.prefix_lens, block, scale)
    if mixed is None:
        return ops.paged_prefill_attention(*args, max(meta.query_lens))
    out = ops.paged_prefill_attention(*args, mixed.prefill_max_query, mixed.prefill_seqs)  # its rows only
    decoded = ops.paged_decode_attention(
        q.index_select(0, mixed.decode_rows), k_cache, v_cache, mixed.decode_tables, mixed.decode_seq_lens,
        block, scale, mixed.decode_max_context,
    )  # fmt: skip
    return out.index_copy_(0, mixed.decode_rows, decoded)


class KVCache:
    """Per-layer K and V tensors of ``num_blocks * block_size`` slots each."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # Called after each layer has stored its K/V: lets a prefill engine send that layer at once.
        self.on_layer_stored: Callable[[int], None] | None = None

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def layer_stored(self, i: int) -> None:
        if self.on_layer_stored is not None:
            self.on_layer_stored(i)
