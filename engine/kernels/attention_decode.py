"""Paged decode attention: one query token per sequence against its whole context in the paged KV cache.

Grouped-query heads: a program handles one KV head and every query head that shares it, so each K/V tile
is read from memory once per group, not once per query head. Split-K (flash decoding): when the batch has
too few (sequence, KV head) pairs to fill the GPU, each sequence's context is cut into ``num_splits``
ranges computed in parallel; a second kernel merges their partial results by log-sum-exp.
"""

import math

import torch

from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import interpreting, kernel, next_power_of_2, tl


def paged_decode_attention_torch(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [slots, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int: keys each query attends to
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """The reference: each sequence's keys gathered through its block table, softmax in float32."""
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    group = q.shape[1] // k_cache.shape[1]
    out = torch.empty_like(q)
    for b, n in enumerate(context_lens.tolist()):
        pos = torch.arange(n, device=q.device)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        probs = (torch.einsum("hd,nhd->hn", q[b].float(), keys) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, values).to(q.dtype)
    return out


@kernel
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    stride_qb,
    stride_qh,
    stride_cache_slot,
    stride_cache_head,
    stride_table,
    stride_ob,
    stride_oh,
    qk_scale,
    block_size,
    group,
    head_dim,
    num_splits,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * group + g
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < group)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(block_tables_ptr + b * stride_table + n // block_size, mask=n_ok, other=0)
        slot = block.to(tl.int64) * block_size + n % block_size
        offs = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
        kv_mask = n_ok[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [G, N], log2 units
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile holds a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if ONE_SPLIT:
        out = acc / l_i[:, None]
        o_offs = b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partial results [B, Hq, S, D] and their log-sum-exp [B, Hq, S]; an empty split has lse -inf.
        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
        row = (b * group * tl.num_programs(1) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], out, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g < group)


@kernel
def _merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    head_dim,
    num_splits,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    row = (b * num_heads + h) * num_splits + s
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always has keys, so the max is finite
    # A masked lane's weight is 0, but 0 * (whatever a masked load leaves there: NaN, inf) is not 0.
    part = tl.load(
        part_out_ptr + row[:, None] * head_dim + d[None, :],
        mask=s_ok[:, None] & (d < head_dim)[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < head_dim)


_SM_COUNT: dict[int, int] = {}


def default_num_splits(batch: int, kv_heads: int, max_context_len: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, none shorter than 256 keys; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = _SM_COUNT.get(index)
    if sms is None:
        sms = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    wanted = -(-2 * sms // (batch * kv_heads))
    return max(1, min(wanted, -(-max_context_len // 256), 64))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    max_context_len: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same as ``paged_decode_attention_torch``; every context length must be at least 1.
    ``max_context_len`` (known on the host) spares a device sync when choosing ``num_splits``."""
    check_decode(q, k_cache, v_cache, block_tables, context_lens)
    batch, q_heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        longest = int(context_lens.max()) if max_context_len is None else max_context_len
        num_splits = default_num_splits(batch, kv_heads, longest, q.device)
    if num_splits < 1:
        raise KernelInputError(f"paged decode attention: num_splits must be >= 1, got {num_splits}")
    group = q_heads // kv_heads
    dot_fp32 = q.dtype == torch.float32 or interpreting()  # the interpreter has no bf16 arithmetic
    one_split = num_splits == 1
    part_out = out if one_split else q.new_empty((batch, q_heads, num_splits, dim), dtype=torch.float32)
    part_lse = out if one_split else q.new_empty((batch, q_heads, num_splits), dtype=torch.float32)
    block_d = max(16, next_power_of_2(dim))
    _decode_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        out,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale * math.log2(math.e),
        block_size,
        group,
        dim,
        num_splits,
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_N=64 if q.is_cuda else 16,
        BLOCK_D=block_d,
        ONE_SPLIT=one_split,
        DOT_FP32=dot_fp32,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if not one_split:
        _merge_splits_kernel[(batch, q_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            q_heads,
            dim,
            num_splits,
            BLOCK_S=next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def check_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise KernelInputError(
            f"paged decode attention: q {tuple(q.shape)} must be [B, Hq, D], caches "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} equal [slots, Hkv, D]"
        )
    batch, q_heads, dim = q.shape
    if k_cache.shape[2] != dim or q_heads % k_cache.shape[1]:
        raise KernelInputError(
            f"paged decode attention: {q_heads} query heads of dim {dim} do not group over "
            f"{k_cache.shape[1]} KV heads of dim {k_cache.shape[2]}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelInputError(
            f"paged decode attention: q is {q.dtype} but the caches {k_cache.dtype}, {v_cache.dtype}"
        )
    _check_tables(block_tables, batch, "paged decode attention")
    if context_lens.shape != (batch,) or context_lens.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"paged decode attention: context_lens must be [{batch}] int, got "
            f"{tuple(context_lens.shape)} {context_lens.dtype}"
        )
    if q.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise KernelInputError("paged decode attention: q's last dimension and the caches must be contiguous")


def _check_tables(block_tables: torch.Tensor, batch: int, what: str) -> None:
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise KernelInputError(
            f"{what}: block_tables must be [{batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(-1) != 1:
        raise KernelInputError(f"{what}: block_tables must be a contiguous int32/int64 table")
