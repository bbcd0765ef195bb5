"""Attention over the paged KV cache: Triton kernels where ``engine.kernels.ops`` picks them (CUDA), torch
elsewhere (``torch_attention``).

A step's tokens arrive flattened: T new tokens from B sequences, each sequence with some tokens already in
the cache (a cached prefix, earlier prefill chunks, earlier decode steps). ``AttentionMetadata`` says, once
per step, where each new token's K/V goes (``slot_mapping``) and which cache slots each sequence reads
(``block_tables``; the torch path's ``TorchPlan`` is built from them on first use); every layer then stores
and attends.

``engine.step_metadata.StepMetadata`` builds the same metadata from persistent state (a block table row
per running sequence, pinned staging on CUDA); ``build_metadata`` rebuilds it from Python lists each step
(the pipeline-parallel path still uses it).

A mixed step (decode rows, query length 1, beside prefill chunks) is split by ``MixedSplit``: the decode
rows go through the decode kernel, which reads each KV head's K/V once for its whole query-head group and
splits long contexts, where the prefill kernel would read it once per query head and never split; only
the prefill rows go through the prefill kernel. Both paths' indices are built with the rest of the step's
metadata, once, not per layer. The torch path splits a step the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from engine.chunked_attention import chunked_attention, use_chunked
from engine.kernels import ops
from engine.kv_cache import KVCache as KVCache  # (re-exported: its home before it had a module)

try:  # (out, logsumexp) of torch's CPU flash kernel: q/k/v [B, H, L, D], Hq a multiple of Hkv (GQA)
    _FLASH_CPU: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    )
except (AttributeError, RuntimeError):  # a torch without it: the masked SDPA path
    _FLASH_CPU = None


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's part of a step: its block table, tokens already cached, tokens computed now."""

    block_table: Sequence[int]
    num_computed: int
    num_new: int


@dataclass(frozen=True)
class TorchDecode:
    """The decode rows of a step as the torch path reads them: every key slot of each block table row."""

    rows: torch.Tensor | None  # [Bd] long: their flat rows; None when every row of the step decodes
    slots: torch.Tensor  # [Bd, L] long: the cache slot of each key position (padding reads block 0)
    hidden: torch.Tensor  # [Bd, 1, 1, L] bool: True past a sequence's context
    _cache_rows: dict[int, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def cache_rows(self, kv_heads: int) -> torch.Tensor:  # [Bd * Hkv * L] long
        """The row of a [slots * Hkv, D] view of the cache for each (sequence, KV head, key position): the
        keys of a layer in [Bd, Hkv, L, D] order in one gather (built once per step, for the first layer)."""
        rows = self._cache_rows.get(kv_heads)
        if rows is None:
            heads = torch.arange(kv_heads, device=self.slots.device)
            rows = (self.slots[:, None, :] * kv_heads + heads[None, :, None]).reshape(-1)
            self._cache_rows[kv_heads] = rows
        return rows


@dataclass(frozen=True)
class TorchPrefill:
    """One sequence of a step with more than one new token, as the torch path attends it."""

    rows: slice  # its rows of the step
    # Its keys' cache slots: [prefix + new] long, or [prefix] when split; None without a cached prefix
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # [new, prefix + new] bool: True where a query may attend a key (causal)
    # The cached prefix attended apart (``split_prefill``): unmasked over ``slots``, then causal over the
    # chunk's own keys, the two merged by their log-sum-exps; no [new, prefix + new] mask at all
    split: bool = False


@dataclass(frozen=True)
class TorchPlan:
    """A step as the torch path attends it, built once per step and shared by every layer: decode rows
    grouped into one batch, each prefill sequence on its own (no padding to the longest, no mask at all
    for a prompt with nothing cached: SDPA's causal kernel, which skips the keys past each query)."""

    decode: TorchDecode | None
    prefill: tuple[TorchPrefill, ...]


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
    def torch_plan(self) -> TorchPlan:
        """Built on first use, by the torch path only."""
        return _torch_plan(self)


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


def _torch_plan(meta: AttentionMetadata) -> TorchPlan:
    block = meta.block_size
    if meta.is_decode:
        return TorchPlan(_torch_decode(None, meta.block_tables, meta.seq_lens, block), ())
    decode = None
    if meta.mixed is not None:
        m = meta.mixed
        decode = _torch_decode(m.decode_rows, m.decode_tables, m.decode_seq_lens, block)
    prefill = []
    row = 0
    split = _FLASH_CPU is not None and meta.device.type == "cpu"
    for s, n in zip(meta.slices, meta.query_lens, strict=True):
        rows, row = slice(row, row + n), row + n
        if n == 1 and decode is not None:
            continue  # a decode row of a mixed step
        if s.num_computed == 0:
            prefill.append(TorchPrefill(rows, None, None))
            continue
        ctx = s.num_computed + n
        table = torch.as_tensor(list(s.block_table), dtype=torch.long)
        pos = torch.arange(s.num_computed if split else ctx)
        slots = (table[pos // block] * block + pos % block).to(meta.device)
        if split:
            prefill.append(TorchPrefill(rows, slots, None, split=True))
            continue
        mask = pos[None, :] <= torch.arange(s.num_computed, ctx)[:, None]  # query i sits at num_computed + i
        prefill.append(TorchPrefill(rows, slots, mask.to(meta.device)))
    return TorchPlan(decode, tuple(prefill))


def _torch_decode(
    rows: torch.Tensor | None, tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int
) -> TorchDecode:
    pos = torch.arange(tables.shape[1] * block_size, device=tables.device)
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    hidden = pos[None, :] >= seq_lens[:, None]
    return TorchDecode(rows, slots, hidden[:, None, None, :])


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
    return torch_attention(q, k, v, k_cache, v_cache, meta, scale)


def _use_kernels(q: torch.Tensor) -> bool:
    """The kernel path (``kernel_attention``) where Triton runs; ``torch_attention`` elsewhere."""
    return ops.use_triton(q)


def torch_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]: this step's K/V, already stored in the cache
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention in torch ops (CPU): the decode rows through ``grouped_decode``; each long prefill
    sequence in bf16 through ``chunked_attention``, else through one SDPA call, causal by itself when nothing
    of it was cached; a chunk with a cached prefix through ``split_prefill`` on CPU, else one SDPA call over
    its gathered slots with a mask."""
    plan = meta.torch_plan
    d = plan.decode
    if d is not None and d.rows is None:
        return grouped_decode(q, k_cache, v_cache, d, scale)
    out = torch.empty_like(q)
    if d is not None and d.rows is not None:
        decoded = grouped_decode(q.index_select(0, d.rows), k_cache, v_cache, d, scale)
        out.index_copy_(0, d.rows, decoded)
    group = q.shape[1] != k.shape[1]
    for p in plan.prefill:
        chunked = use_chunked(q, p.rows.stop - p.rows.start)  # long bf16 on the CPU: one call, any prefix
        if p.split and not chunked:
            assert p.slots is not None
            queries = q[p.rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            out[p.rows] = split_prefill(queries, k[p.rows], v[p.rows], k_cache, v_cache, p.slots, scale)
            continue
        keys, values = _sequence_kv(p, k, v, k_cache, v_cache)
        if chunked:
            out[p.rows] = chunked_attention(q[p.rows], keys, values, scale)
            continue
        queries = q[p.rows].transpose(0, 1).unsqueeze(0)
        attended = F.scaled_dot_product_attention(
            queries, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
            attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=group,
        )  # fmt: skip
        out[p.rows] = attended[0].transpose(0, 1)
    return out


def _sequence_kv(
    p: TorchPrefill, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # [keys, Hkv, D] each
    """Every key and value ``p``'s queries attend, in order: its own rows' when nothing of it was cached,
    else its slots' (followed by its own rows' when the plan split the cached prefix off)."""
    if p.slots is None:
        return k[p.rows], v[p.rows]
    keys, values = k_cache.index_select(0, p.slots), v_cache.index_select(0, p.slots)
    if p.split:  # (the slots are the prefix's only)
        keys, values = torch.cat((keys, k[p.rows])), torch.cat((values, v[p.rows]))
    return keys, values


def split_prefill(
    queries: torch.Tensor,  # [1, Hq, n, D]: a prefill chunk's queries
    k: torch.Tensor,  # [n, Hkv, D]: the chunk's own K/V
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    prefix: torch.Tensor,  # [P] long: the cache slots of the sequence's P tokens before the chunk
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """A chunk with a cached prefix as two calls of torch's CPU flash kernel, neither with a mask: the chunk's
    queries over every prefix key, then over the chunk's own keys causally (a square: query i sees keys
    0..i), merged by their log-sum-exps as split-KV flash attention merges its splits. With an explicit
    [n, P + n] mask, SDPA takes a path several times slower on a long context (an O(n * (P + n)) mask)."""
    assert _FLASH_CPU is not None
    kp = k_cache.index_select(0, prefix).transpose(0, 1).unsqueeze(0)  # [1, Hkv, P, D]
    vp = v_cache.index_select(0, prefix).transpose(0, 1).unsqueeze(0)
    out_a, lse_a = _FLASH_CPU(queries, kp, vp, 0.0, False, scale=scale)  # [1, Hq, n, D], [1, Hq, n] fp32
    kn, vn = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    out_b, lse_b = _FLASH_CPU(queries, kn, vn, 0.0, True, scale=scale)
    # exp(lse_a) / (exp(lse_a) + exp(lse_b)), stably: every row has keys in both parts (both lse finite)
    weight = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)
    merged = torch.lerp(out_b.float(), out_a.float(), weight)  # out_b + weight * (out_a - out_b)
    return merged[0].transpose(0, 1).to(queries.dtype)


def grouped_decode(
    q: torch.Tensor,  # [B, Hq, D]: one query per sequence
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    d: TorchDecode,
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention as two batched matmuls in the cache's dtype with a float32 softmax between them (as
    transformers' eager attention rounds): each KV head's query heads are one [G, D] matrix, so K/V are
    neither repeated nor read per query head. torch's SDPA with one query per sequence was 4-5x slower in
    bf16 than in fp32 on an AVX-512 CPU without AMX; this is as fast in fp32 and ~4x faster in bf16."""
    b, hq, dim = q.shape
    hkv = k_cache.shape[1]
    rows = d.cache_rows(hkv)
    keys = k_cache.view(-1, dim).index_select(0, rows).view(b, hkv, -1, dim)  # [B, Hkv, L, D]
    values = v_cache.view(-1, dim).index_select(0, rows).view(b, hkv, -1, dim)
    scores = torch.matmul(q.reshape(b, hkv, hq // hkv, dim), keys.transpose(-1, -2))  # [B, Hkv, G, L]
    probs = scores.float().mul_(scale).masked_fill_(d.hidden, float("-inf")).softmax(-1).to(q.dtype)
    return torch.matmul(probs, values).view(b, hq, dim)  # [B, Hkv, G, D] -> [B, Hq, D]


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
