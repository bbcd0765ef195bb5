"""CPU linears through oneDNN with each weight packed once, at load (what inductor's freezing does for vLLM's
CPU build): torch's default fp32 GEMM (MKL) runs 2-3x slower on this project's AVX-512 test CPU. bf16 is
packed only where oneDNN can (AVX-512 or AVX-NE-CONVERT): ``can_pack`` asks it once per dtype.

Measured there, one thread, ms per call: fp32 [2000, 256] x [256, 2048] 22.1 -> 9.2, the tied head at 16
decode rows, [16, 256] x [256, 16384], 2.76 -> 0.88; bf16 goes through oneDNN already, packing saves 10-40 %
at decode sizes. The packed weight replaces the module's own, except a head tied to the embedding: the
embedding keeps the dense weight and the head holds a packed copy (vocabulary x hidden more memory).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.parallel.layers import MergedColumnLinear

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch has oneDNN's packed linear (a CPU build with mkldnn) and this CPU runs it in
    ``dtype``: oneDNN packs bf16 only on CPUs with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and refuses it
    elsewhere (an AVX2-only CPU), where F.linear still computes bf16 its own way."""
    mkldnn = torch.ops.mkldnn
    return (
        dtype in PACKED_DTYPES
        and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and _packs(dtype)
    )


@functools.cache
def _packs(dtype: torch.dtype) -> bool:
    """One tiny pack and product in ``dtype`` (once per process): what this CPU can do, asked of oneDNN."""
    try:
        PackedLinear(torch.ones(4, 4, dtype=dtype), None)(torch.ones(1, 4, dtype=dtype))
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` with ``weight`` [out, in] held in oneDNN's packed layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` and ``MergedColumnLinear`` of a CPU model in fp32 or bf16 (a single
    rank's: the tensor-parallel layers communicate) by a ``PackedLinear``; returns how many. Nothing on
    other devices or dtypes, or where this torch or CPU cannot pack."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear | MergedColumnLinear)
        and child.weight.device.type == "cpu"
        and can_pack(child.weight.dtype)
    ]
    with torch.no_grad():
        for parent, name, child in targets:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
    return len(targets)
