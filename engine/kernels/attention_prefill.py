"""Prefill attention over a cached paged prefix: a step's new tokens attend causally to their sequence's
tokens already in the cache (read through the block table) and to each other.

The step is flattened (``query_start`` [B + 1] gives each sequence's rows of q, k and v), so one launch
serves a batch of prompts, prefill chunks and single decode tokens alike. A program computes BLOCK_M query
rows of one head in two passes of the same online softmax: the cached prefix (every key visible), then the
new keys themselves (causal), read from k and v directly rather than from the cache.

``seq_ids`` restricts a call to some of the step's sequences (a mixed step sends its decode rows to the
decode kernel instead): their rows of the output are written, the other rows are left unwritten.
"""

import math

import torch

from engine.kernels.attention_decode import _check_tables
from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import interpreting, kernel, next_power_of_2, tl


def paged_prefill_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]: the step's new tokens
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [slots, Hkv, D]: each sequence's first prefix_lens[b] tokens
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    query_start: torch.Tensor,  # [B + 1] int: sequence b owns rows query_start[b]:query_start[b + 1]
    prefix_lens: torch.Tensor,  # [B] int: tokens of each sequence already in the cache
    block_size: int,
    scale: float,
    seq_ids: torch.Tensor | None = None,  # [Bp] int: only these sequences (their rows of the output)
) -> torch.Tensor:  # [T, Hq, D]
    """The reference: prefix keys gathered through the block table, then the new keys; float32 softmax."""
    check_prefill(q, k, v, k_cache, v_cache, block_tables, query_start, prefix_lens, seq_ids)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    starts = query_start.tolist()
    prefixes = prefix_lens.tolist()
    for b in range(len(prefixes)) if seq_ids is None else seq_ids.tolist():
        prefix = prefixes[b]
        rows = slice(starts[b], starts[b + 1])
        pos = torch.arange(prefix, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = torch.cat((k_cache[slots].float(), k[rows].float())).repeat_interleave(group, dim=1)
        values = torch.cat((v_cache[slots].float(), v[rows].float())).repeat_interleave(group, dim=1)
        new = starts[b + 1] - starts[b]
        q_pos = torch.arange(prefix, prefix + new, device=q.device)[None, :, None]
        k_pos = torch.arange(prefix + new, device=q.device)[None, None, :]
        scores = torch.einsum("thd,nhd->htn", q[rows].float(), keys) * scale  # [Hq, new, prefix + new]
        probs = scores.masked_fill(k_pos > q_pos, float("-inf")).softmax(-1)
        out[rows] = torch.einsum("htn,nhd->thd", probs, values).to(q.dtype)
    return out


@kernel
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    prefix_lens_ptr,
    seq_ids_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_ot,
    stride_oh,
    qk_scale,
    block_size,
    group,
    head_dim,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_SEQ_IDS: tl.constexpr,
):
    m_block = tl.program_id(0)
    b = tl.program_id(1)
    if HAS_SEQ_IDS:  # the grid covers only the listed sequences
        b = tl.load(seq_ids_ptr + b)
    head = tl.program_id(2)
    kv_head = head // group
    row0 = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - row0
    if m_block * BLOCK_M >= q_len:
        return
    prefix = tl.load(prefix_lens_ptr + b)

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among the sequence's new tokens
    d = tl.arange(0, BLOCK_D)
    d_ok = (d < head_dim)[None, :]
    q_mask = (m < q_len)[:, None] & d_ok
    rows = (row0 + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Pass 1: the cached prefix, all of it before every new token.
    for n0 in range(0, prefix, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < prefix
        block = tl.load(block_tables_ptr + b * stride_table + n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        offs = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=n_ok[:, None] & d_ok, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=n_ok[:, None] & d_ok, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N], log2 units
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key n0 is valid for every row
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # Pass 2: the new tokens, causal; keys past this block's last query are never needed.
    for n0 in range(0, tl.minimum(q_len, (m_block + 1) * BLOCK_M), BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < q_len
        key_rows = (row0 + n).to(tl.int64)
        k = tl.load(
            k_ptr + key_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
            mask=n_ok[:, None] & d_ok,
            other=0.0,
        )
        v = tl.load(
            v_ptr + key_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
            mask=n_ok[:, None] & d_ok,
            other=0.0,
        )
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :] & (n[None, :] <= m[:, None]), s, float("-inf"))
        # A row may see no key in this tile (all its keys came earlier): its max stays m_i, finite by now.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


def paged_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_size: int,
    scale: float,
    max_query_len: int | None = None,
    seq_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same as ``paged_prefill_attention_torch``. ``max_query_len`` (known on the host; over ``seq_ids``
    when given) sizes the grid without a device sync."""
    check_prefill(q, k, v, k_cache, v_cache, block_tables, query_start, prefix_lens, seq_ids)
    tokens, q_heads, dim = q.shape
    out = torch.empty_like(q)
    batch = prefix_lens.shape[0] if seq_ids is None else seq_ids.shape[0]
    if tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        lens = query_start[1:] - query_start[:-1]
        max_query_len = int((lens if seq_ids is None else lens[seq_ids.long()]).max())
    block_m = 64 if q.is_cuda else 16
    block_n = 64 if q.is_cuda else 16
    block_d = max(16, next_power_of_2(dim))
    if q.is_cuda and (block_d > 128 or q.dtype == torch.float32):  # [M, D] accumulator and tiles in registers
        block_m, block_n = 32, 32
    grid = (-(-max_query_len // block_m), batch, q_heads)
    _prefill_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        prefix_lens,
        query_start if seq_ids is None else seq_ids,  # unread without seq_ids
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * math.log2(math.e),
        block_size,
        q_heads // k.shape[1],
        dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_FP32=q.dtype == torch.float32 or interpreting(),  # the interpreter has no bf16 arithmetic
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HAS_SEQ_IDS=seq_ids is not None,
        num_warps=4,
        num_stages=2,
    )
    return out


def check_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    prefix_lens: torch.Tensor,
    seq_ids: torch.Tensor | None = None,
) -> None:
    what = "paged prefill attention"
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise KernelInputError(
            f"{what}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must be [T, H, D]"
        )
    if k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise KernelInputError(f"{what}: caches {tuple(k_cache.shape)} do not hold k {tuple(k.shape)}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise KernelInputError(
            f"{what}: {q.shape[1]} query heads of dim {q.shape[2]} do not group over {k.shape[1]} KV heads "
            f"of dim {k.shape[2]}"
        )
    if len({q.dtype, k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) != 1:
        raise KernelInputError(
            f"{what}: q, k, v and the caches must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}, "
            f"{k_cache.dtype}, {v_cache.dtype}"
        )
    batch = prefix_lens.shape[0] if prefix_lens.dim() == 1 else -1
    if batch < 0 or query_start.shape != (batch + 1,):
        raise KernelInputError(
            f"{what}: prefix_lens must be [B] and query_start [B + 1], got {tuple(prefix_lens.shape)} and "
            f"{tuple(query_start.shape)}"
        )
    if not {query_start.dtype, prefix_lens.dtype} <= {torch.int32, torch.int64}:
        raise KernelInputError(f"{what}: query_start and prefix_lens must be int32/int64")
    _check_tables(block_tables, batch, what)
    if seq_ids is not None and (
        seq_ids.dim() != 1 or seq_ids.dtype not in (torch.int32, torch.int64) or seq_ids.stride(0) != 1
    ):
        raise KernelInputError(f"{what}: seq_ids must be a contiguous [Bp] int32/int64 tensor")
    if any(t.stride(-1) != 1 for t in (q, k, v)) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise KernelInputError(f"{what}: q, k, v need a contiguous last dimension, the caches contiguity")
