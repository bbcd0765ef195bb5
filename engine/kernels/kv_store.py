"""Writes a step's new K and V into their cache slots (``slot = block * block_size + offset``).

The cache layout is ``[num_blocks * block_size, num_kv_heads, head_dim]`` per layer, so one token's K is
one contiguous row of ``num_kv_heads * head_dim`` values: a program per token copies two rows.
"""

import torch

from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import kernel, next_power_of_2, tl


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    k_cache[slot_mapping] = k.to(k_cache.dtype)
    v_cache[slot_mapping] = v.to(v_cache.dtype)


@kernel
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_slot,
    stride_cache_head,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: slot * stride passes 2**31 in a large cache
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    ok = (heads < num_heads) & (dims < head_dim)
    cache_offs = slot * stride_cache_slot + heads * stride_cache_head + dims
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=ok)
    tl.store(k_cache_ptr + cache_offs, k.to(k_cache_ptr.dtype.element_ty), mask=ok)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=ok)
    tl.store(v_cache_ptr + cache_offs, v.to(v_cache_ptr.dtype.element_ty), mask=ok)


def store_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """``k``, ``v`` [T, Hkv, D] into ``k_cache``, ``v_cache`` [slots, Hkv, D] at ``slot_mapping`` [T]."""
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    t, heads, dim = k.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        heads,
        dim,
        BLOCK_H=next_power_of_2(heads),
        BLOCK_D=next_power_of_2(dim),
        num_warps=4,
    )


def check_store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if k.dim() != 3 or k.shape != v.shape:
        raise KernelInputError(
            f"store_kv: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]"
        )
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.shape[1:] != k.shape[1:]:
        raise KernelInputError(
            f"store_kv: caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not hold k {tuple(k.shape)}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise KernelInputError(
            f"store_kv: slot_mapping must be [{k.shape[0]}] int32/int64, got "
            f"{tuple(slot_mapping.shape)} {slot_mapping.dtype}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise KernelInputError("store_kv: head_dim must be contiguous and the caches contiguous")
