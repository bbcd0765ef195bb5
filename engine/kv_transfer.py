"""KV transfer between engines: the prefill engine streams K/V to the decode engine, layer by layer.

The decode engine pulls: it has already matched its own prefix cache, so it asks only for the positions it
lacks (``from_position`` onwards). The prefill engine answers with a stream of frames while it computes:
each layer's K/V leaves as soon as that layer is done, so the transfer overlaps the prefill.

A KV pull uses the same frames: a peer engine asks ``/v1/kv/cached`` for positions its own cache lacks, and
the source sends, between two of its steps, those its prefix cache holds (a run of full blocks), which may
stop short of what was asked: the done frame says how far it got.

Frame: ``[u32 little-endian header length][msgpack header][payload]``. Headers:
- ``{"t": "kv", "layer", "start", "count", "dtype", "heads", "dim"}``: the payload is K then V for positions
  ``start .. start + count`` of one layer, raw tensor bytes ``[count, heads, dim]`` (no per-element Python);
- ``{"t": "done", "tokens", "cached_tokens"}``: every position up to ``tokens`` was sent; the source's cache
  hit (a pull: the same as ``tokens``);
- ``{"t": "error", "message"}``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgpack
import torch

CONTENT_TYPE = "application/x-kvgate-kv"
_LEN = struct.Struct("<I")
_MAX_HEADER = 1 << 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class KvTransferError(RuntimeError):
    """A transfer that broke, lied about its shapes, or ended early."""


def frame(header: dict[str, Any], *payload: torch.Tensor) -> list[Any]:
    """A frame as buffers for a single vectored write; tensors go out as their own bytes (zero-copy)."""
    head = msgpack.packb(header)
    return [_LEN.pack(len(head)), head, *(t.contiguous().view(torch.uint8).numpy() for t in payload)]


def kv_frame(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
    count, heads, dim = k.shape
    header = {"t": "kv", "layer": layer, "start": start, "count": count, "dtype": DTYPE_NAMES[k.dtype],
              "heads": heads, "dim": dim}  # fmt: skip
    return frame(header, k, v)


class ByteSource(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


@dataclass(frozen=True)
class KvChunk:
    layer: int
    start: int
    k: torch.Tensor  # [count, heads, dim]
    v: torch.Tensor


async def read_frame(source: ByteSource) -> KvChunk | dict[str, Any]:
    """The next frame: a KvChunk, or the header of a done/error frame."""
    (length,) = _LEN.unpack(await source.readexactly(_LEN.size))
    if not 0 < length <= _MAX_HEADER:
        raise KvTransferError(f"frame header of {length} bytes")
    try:
        header = msgpack.unpackb(await source.readexactly(length))
    except (ValueError, msgpack.UnpackException) as exc:
        raise KvTransferError(f"frame header is not msgpack: {exc}") from None
    if not isinstance(header, dict) or header.get("t") not in ("kv", "done", "error"):
        raise KvTransferError(f"unknown frame {header!r}")
    if header["t"] != "kv":
        return header
    try:
        dtype = DTYPES[header["dtype"]]
        shape = (int(header["count"]), int(header["heads"]), int(header["dim"]))
        layer, start = int(header["layer"]), int(header["start"])
    except (KeyError, TypeError, ValueError):
        raise KvTransferError(f"malformed kv frame header {header!r}") from None
    size = shape[0] * shape[1] * shape[2] * torch.empty((), dtype=dtype).element_size()
    data = await source.readexactly(2 * size)
    both = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    return KvChunk(
        layer,
        start,
        both[: size // both.element_size()].view(shape),
        both[size // both.element_size() :].view(shape),
    )


def position_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of positions ``start .. end`` of a sequence."""
    table = torch.as_tensor(block_table, dtype=torch.long)
    positions = torch.arange(start, end, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


FrameSink = Callable[[list[Any]], None]
