"""KV transfer between engines: the prefill engine streams K/V to the decode engine, layer by layer.

The decode engine pulls: it has already matched its own prefix cache, so it asks only for the positions it
lacks (``from_position`` onwards). The prefill engine answers with a stream of frames while it computes:
each layer's K/V leaves as soon as that layer is done, so the transfer overlaps the prefill.

A KV pull uses the same frames: a peer engine asks ``/v1/kv/cached`` for positions its own cache lacks, and
the source sends, between two of its steps, those its prefix cache holds (a run of full blocks), which may
stop short of what was asked: the done frame says how far it got.

Frame (``engine.kv_wire``, which needs no torch): ``[u32 little-endian header length][msgpack header]
[payload]``. Headers:
- ``{"t": "kv", "layer", "start", "count", "dtype", "heads", "dim"}``: the payload is K then V for positions
  ``start .. start + count`` of one layer, raw tensor bytes ``[count, heads, dim]`` (no per-element Python);
- ``{"t": "done", "tokens", "cached_tokens"}``: every position up to ``tokens`` was sent; the source's cache
  hit (a pull: the same as ``tokens``);
- ``{"t": "error", "message"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.kv_wire import CONTENT_TYPE, ByteSource, KvTransferError, pack, payload_bytes, read_header

__all__ = ["CONTENT_TYPE", "KvChunk", "KvTransferError", "frame", "kv_frame", "position_slots", "read_frame"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def frame(header: dict[str, Any], *payload: torch.Tensor) -> list[Any]:
    """A frame as buffers for a single vectored write; tensors go out as their own bytes (zero-copy)."""
    return pack(header, *(t.contiguous().view(torch.uint8).numpy() for t in payload))


def kv_frame(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
    count, heads, dim = k.shape
    header = {"t": "kv", "layer": layer, "start": start, "count": count, "dtype": DTYPE_NAMES[k.dtype],
              "heads": heads, "dim": dim}  # fmt: skip
    return frame(header, k, v)


@dataclass(frozen=True)
class KvChunk:
    layer: int
    start: int
    k: torch.Tensor  # [count, heads, dim]
    v: torch.Tensor


async def read_frame(source: ByteSource) -> KvChunk | dict[str, Any]:
    """The next frame: a KvChunk, or the header of a done/error frame."""
    header = await read_header(source)
    if header["t"] != "kv":
        return header
    dtype = DTYPES[header["dtype"]]
    shape = (header["count"], header["heads"], header["dim"])
    data = await source.readexactly(payload_bytes(header))
    both = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    half = both.numel() // 2
    return KvChunk(header["layer"], header["start"], both[:half].view(shape), both[half:].view(shape))


def position_slots(block_table: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Cache slots of positions ``start .. end`` of a sequence."""
    table = torch.as_tensor(block_table, dtype=torch.long)
    positions = torch.arange(start, end, dtype=torch.long)
    return table[positions // block_size] * block_size + positions % block_size


FrameSink = Callable[[list[Any]], None]
