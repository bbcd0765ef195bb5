"""The engine's kernel calls: Triton for CUDA tensors when Triton is installed, torch otherwise.

Triton also runs on CPU tensors when ``TRITON_INTERPRET=1`` is set (its interpreter: for tests, slow).
Each function validates its inputs (``KernelInputError``) whichever path runs.
"""

from __future__ import annotations

import torch

from engine.kernels.activation import check_silu_and_mul, silu_and_mul_torch, silu_and_mul_triton
from engine.kernels.attention_decode import paged_decode_attention_torch, paged_decode_attention_triton
from engine.kernels.attention_prefill import paged_prefill_attention_torch, paged_prefill_attention_triton
from engine.kernels.kv_store import check_store_kv, store_kv_torch, store_kv_triton
from engine.kernels.norm import check_rms_norm, rms_norm_torch, rms_norm_triton
from engine.kernels.rotary import check_rotary, rotary_torch, rotary_triton
from engine.kernels.triton_support import HAVE_TRITON, interpreting


def use_triton(t: torch.Tensor) -> bool:
    """Whether the kernels run in Triton for tensors on ``t``'s device."""
    return HAVE_TRITON and (t.is_cuda or interpreting())


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (RMSNorm(x + residual) * weight, x + residual), transformers' rounding; ``residual`` optional."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, residual)
    check_rms_norm(x, weight, residual)
    return rms_norm_torch(x, weight, eps, residual)


def rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated by cos/sin [T, D] (``rotate_half`` convention)."""
    if use_triton(q):
        return rotary_triton(q, k, cos, sin)
    check_rotary(q, k, cos, sin)
    return rotary_torch(q, k, cos, sin)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if use_triton(gate):
        return silu_and_mul_triton(gate, up)
    check_silu_and_mul(gate, up)
    return silu_and_mul_torch(gate, up)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``k``, ``v`` [T, Hkv, D] into the caches [slots, Hkv, D] at ``slot_mapping`` [T]."""
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    check_store_kv(k, v, k_cache, v_cache, slot_mapping)
    store_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence, q [B, Hq, D] -> [B, Hq, D]; see ``attention_decode``."""
    if use_triton(q):
        return paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, block_size, scale, max_context_len
        )
    return paged_decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)


def paged_prefill_attention(
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
    """New tokens q [T, Hq, D] over their cached prefix and themselves -> [T, Hq, D]; with ``seq_ids`` only
    those sequences' rows are written. See ``attention_prefill``."""
    args = (q, k, v, k_cache, v_cache, block_tables, query_start, prefix_lens)
    if use_triton(q):
        return paged_prefill_attention_triton(*args, block_size, scale, max_query_len, seq_ids)
    return paged_prefill_attention_torch(*args, block_size, scale, seq_ids)
