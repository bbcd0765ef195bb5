"""Split floats into one byte that entropy-codes well (the exponent) and raw bytes that do not, and back.

BF16 ``s eeeeeeee mmmmmmm``: symbol = the exponent, rest = the sign above the 7 mantissa bits.
F32: symbol = the exponent, rest = sign + the top 7 mantissa bits, then the two low mantissa bytes.
F16 ``s eeeee mm mmmmmmmm``: symbol = the high byte (sign, exponent, 2 mantissa bits), rest = the low byte;
the coder's table makes the mixed-in sign and mantissa bits cost what they are worth.
``_rans.c``'s ``put`` is the native ``merge``; the two must agree bit for bit.
"""

from __future__ import annotations

import numpy as np

KIND_BYTES, KIND_BF16, KIND_F16, KIND_F32 = 0, 1, 2, 3
KINDS = {"BF16": KIND_BF16, "F16": KIND_F16, "F32": KIND_F32}  # safetensors' dtype names
WORD = {KIND_BF16: "<u2", KIND_F16: "<u2", KIND_F32: "<u4"}  # how to view a tensor's bytes
REST_WIDTH = {KIND_BF16: 1, KIND_F16: 1, KIND_F32: 3}


def split(raw: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """(symbols [n] uint8, rest [n * REST_WIDTH] uint8) of a tensor's bytes (any shape of uint8)."""
    u = np.ascontiguousarray(raw).reshape(-1).view(WORD[kind])
    if kind == KIND_BF16:
        return ((u >> 7) & 0xFF).astype(np.uint8), (((u >> 8) & 0x80) | (u & 0x7F)).astype(np.uint8)
    if kind == KIND_F16:
        return (u >> 8).astype(np.uint8), (u & 0xFF).astype(np.uint8)
    if kind == KIND_F32:
        rest = np.empty((u.size, 3), dtype=np.uint8)
        rest[:, 0] = ((u >> 24) & 0x80) | ((u >> 16) & 0x7F)
        rest[:, 1] = (u >> 8) & 0xFF
        rest[:, 2] = u & 0xFF
        return ((u >> 23) & 0xFF).astype(np.uint8), rest.reshape(-1)
    raise ValueError(f"unknown kind {kind}")


def merge(symbols: np.ndarray, rest: np.ndarray, kind: int) -> np.ndarray:
    """The tensor's bytes (uint8) again from ``split``'s two parts."""
    s = symbols.astype(np.uint32)
    if kind == KIND_BF16:
        r = rest.astype(np.uint32)
        u = ((r & 0x80) << 8) | (s << 7) | (r & 0x7F)
    elif kind == KIND_F16:
        u = (s << 8) | rest.astype(np.uint32)
    elif kind == KIND_F32:
        r = rest.reshape(-1, 3).astype(np.uint32)
        u = ((r[:, 0] & 0x80) << 24) | (s << 23) | ((r[:, 0] & 0x7F) << 16) | (r[:, 1] << 8) | r[:, 2]
    else:
        raise ValueError(f"unknown kind {kind}")
    return u.astype(WORD[kind]).view(np.uint8)
