"""The Triton kernels that expand a palette-form weight (palette.py) to BF16 on the GPU: a dense pass over
every element, then a patch pass over the exceptions. ``expand`` picks them for CUDA tensors (or under
``TRITON_INTERPRET=1``), the native CPU pass or the torch reference otherwise; all write the same bits.
"""

# No `from __future__ import annotations`: the interpreter needs tl.constexpr as a real annotation.

import torch

from engine.compress import codec
from engine.compress.palette import PaletteWeight, expand_native, expand_reference
from engine.kernels.triton_support import HAVE_TRITON, interpreting, kernel, tl

BLOCK = 1024


@kernel
def _expand_kernel(codes_ptr, low_ptr, palette_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    byte = tl.load(codes_ptr + (offs >> 1), mask=mask, other=0).to(tl.int32)
    code = (byte >> ((offs & 1) * 4)) & 15
    high = tl.load(palette_ptr + code, mask=mask, other=0).to(tl.int32)  # sign-extends: the low 16 bits stay
    low = tl.load(low_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + offs, (high | low).to(tl.int16), mask=mask)


@kernel
def _patch_kernel(out_ptr, index_ptr, value_ptr, m, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    index = tl.load(index_ptr + offs, mask=mask, other=0)
    value = tl.load(value_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + index, value, mask=mask)


def expand_triton(pw: PaletteWeight, out: torch.Tensor) -> torch.Tensor:
    """The Triton expansion into ``out`` (contiguous bfloat16, ``pw.numel`` elements); returns ``out``."""
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() != pw.numel:
        raise ValueError(f"out must be a contiguous bfloat16 tensor of {pw.numel} elements")
    flat = out.view(-1).view(torch.int16)
    n, m = pw.numel, pw.exception_index.numel()
    _expand_kernel[(triton_cdiv(n, BLOCK),)](pw.codes, pw.low, pw.palette, flat, n, BLOCK=BLOCK)
    if m:
        _patch_kernel[(triton_cdiv(m, BLOCK),)](flat, pw.exception_index, pw.exception_value, m, BLOCK=BLOCK)
    return out


def expand(pw: PaletteWeight, out: torch.Tensor) -> torch.Tensor:
    """Expand with Triton on CUDA (or in its interpreter), natively on CPU when the extension is built,
    else with the torch reference."""
    if HAVE_TRITON and (out.is_cuda or interpreting()):
        return expand_triton(pw, out)
    if out.device.type == "cpu" and codec.native_available():
        return expand_native(pw, out)
    return expand_reference(pw, out)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
