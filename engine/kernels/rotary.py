"""Rotary position embedding in the Hugging Face convention (``rotate_half``), applied to q and k together.

cos and sin are [T, D] per token (the model computes them once per step from each token's position), so a
step mixing sequences and chunks needs nothing special.
"""

import torch

from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import kernel, next_power_of_2, tl


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] rotated by cos/sin [T, D] of each token's position."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]: broadcast over heads
    return x * cos + rotate_half(x) * sin


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary_torch(q, cos, sin), apply_rotary_torch(k, cos, sin)


@kernel
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    stride_q_out_t,
    stride_q_out_h,
    stride_k_out_t,
    stride_k_out_h,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    dims = tl.arange(0, BLOCK_HALF)
    dim_ok = dims < half
    # Both halves of cos and sin are read: the reference multiplies by the whole [D] row.
    cos1 = tl.load(cos_ptr + t * stride_cos + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + t * stride_cos + half + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + t * stride_sin + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + t * stride_sin + half + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]

    qh = tl.arange(0, BLOCK_QH)[:, None]
    q_ok = (qh < num_q_heads) & dim_ok[None, :]
    q_in = q_ptr + t * stride_qt + qh * stride_qh + dims[None, :]
    x1 = tl.load(q_in, mask=q_ok, other=0.0).to(tl.float32)
    x2 = tl.load(q_in + half, mask=q_ok, other=0.0).to(tl.float32)
    q_out = q_out_ptr + t * stride_q_out_t + qh * stride_q_out_h + dims[None, :]
    tl.store(q_out, (x1 * cos1 - x2 * sin1).to(q_out_ptr.dtype.element_ty), mask=q_ok)
    tl.store(q_out + half, (x2 * cos2 + x1 * sin2).to(q_out_ptr.dtype.element_ty), mask=q_ok)

    kh = tl.arange(0, BLOCK_KH)[:, None]
    k_ok = (kh < num_k_heads) & dim_ok[None, :]
    k_in = k_ptr + t * stride_kt + kh * stride_kh + dims[None, :]
    y1 = tl.load(k_in, mask=k_ok, other=0.0).to(tl.float32)
    y2 = tl.load(k_in + half, mask=k_ok, other=0.0).to(tl.float32)
    k_out = k_out_ptr + t * stride_k_out_t + kh * stride_k_out_h + dims[None, :]
    tl.store(k_out, (y1 * cos1 - y2 * sin1).to(k_out_ptr.dtype.element_ty), mask=k_ok)
    tl.store(k_out + half, (y2 * cos2 + y1 * sin2).to(k_out_ptr.dtype.element_ty), mask=k_ok)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated in one launch; returns new tensors."""
    check_rotary(q, k, cos, sin)
    t, q_heads, dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if t == 0:
        return q_out, k_out
    half = dim // 2
    _rotary_kernel[(t,)](
        q,
        k,
        cos,
        sin,
        q_out,
        k_out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        q_heads,
        k.shape[1],
        half,
        BLOCK_QH=next_power_of_2(q_heads),
        BLOCK_KH=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out


def check_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise KernelInputError(f"rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] alike")
    t, _, dim = q.shape
    if dim % 2 or cos.shape != (t, dim) or sin.shape != (t, dim):
        raise KernelInputError(
            f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [{t}, {dim}] (D even)"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise KernelInputError("rotary: the last dimension of q, k, cos and sin must be contiguous")
