"""RMSNorm, optionally with the residual add fused in front of it (``x + residual``, then its norm).

Semantics are transformers': the sum is rounded to the input dtype, normalised in float32, cast back, and
only then multiplied by the weight in the input dtype, so the torch path is bit for bit the model's.
"""

import torch

from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import kernel, next_power_of_2, tl


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (norm(x + residual) * weight, x + residual); without ``residual`` the second item is ``x``."""
    if residual is not None:
        x = x + residual
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


@kernel
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_sum,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    # Arithmetic runs in float32 and is rounded where transformers rounds (the interpreter has no bf16 math).
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=ok, other=0.0).to(tl.float32)
        x = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=ok)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton version of ``rms_norm_torch`` (same arguments, same results up to rounding)."""
    check_rms_norm(x, weight, residual)
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    out = torch.empty_like(rows, dtype=torch.promote_types(weight.dtype, x.dtype))
    if residual is None:
        res_rows, total = rows, rows
    else:
        res_rows = residual.reshape(-1, shape[-1])
        total = torch.empty_like(rows)
    n_cols = shape[-1]
    block = next_power_of_2(n_cols)
    if rows.shape[0] > 0:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res_rows,
            weight,
            out,
            total,
            rows.stride(0),
            res_rows.stride(0),
            out.stride(0),
            total.stride(0),
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    return out.view(shape), (x if residual is None else total.view(shape))


def check_rms_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
        raise KernelInputError(f"rms_norm: weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise KernelInputError(
            f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} differs from x "
            f"{tuple(x.shape)} {x.dtype}"
        )
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise KernelInputError("rms_norm: the last dimension must be contiguous")
