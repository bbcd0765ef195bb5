"""SiLU-and-multiply, the gate of a gated MLP: ``silu(gate) * up``."""

import torch
import torch.nn.functional as F

from engine.kernels.errors import KernelInputError
from engine.kernels.triton_support import kernel, next_power_of_2, tl


def silu_and_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@kernel
def _silu_and_mul_kernel(
    gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, n_cols, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gate_ptr + row * stride_gate + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_up + cols, mask=ok, other=0.0).to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the two torch ops do.
    act = (g / (1.0 + tl.exp(-g))).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate`` and ``up`` [..., I] (views of one merged projection are fine: only rows may be strided)."""
    check_silu_and_mul(gate, up)
    n_cols = gate.shape[-1]
    g, u = gate.reshape(-1, n_cols), up.reshape(-1, n_cols)
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = min(4096, next_power_of_2(n_cols))
    if g.shape[0] > 0:
        grid = (g.shape[0], -(-n_cols // block))
        _silu_and_mul_kernel[grid](
            g, u, out, g.stride(0), u.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
        )
    return out.view(gate.shape)


def check_silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise KernelInputError(
            f"silu_and_mul: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ"
        )
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise KernelInputError("silu_and_mul: the last dimension must be contiguous")
