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
  a layer may come in several frames, in position order;
- ``{"t": "done", "tokens", "cached_tokens"}``: every position up to ``tokens`` was sent; the source's cache
  hit (a pull: the same as ``tokens``);
- ``{"t": "error", "message"}``.

The sender stages a frame's K/V in a host buffer with one gather (``stage_layer``; on a GPU the gather runs
on the step's stream and the copy to page-locked memory on a side stream, so the step never waits), and
the writer sends the buffer as it is, after the header, never joined to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_staging import HostBuffers, SendWindow, side_stream
from engine.kv_wire import CONTENT_TYPE, ByteSource, KvTransferError, head, pack, payload_bytes, read_header

__all__ = [
    "CONTENT_TYPE",
    "KvChunk",
    "KvTransferError",
    "StagedFrame",
    "frame",
    "kv_frame",
    "position_slots",
    "read_frame",
    "stage_frame",
    "stage_layer",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def frame(header: dict[str, Any], *payload: torch.Tensor) -> list[Any]:
    """A frame as buffers for a single vectored write; tensors go out as their own bytes (zero-copy)."""
    return pack(header, *(t.contiguous().view(torch.uint8).numpy() for t in payload))


def kv_header(layer: int, start: int, count: int, dtype: torch.dtype, heads: int, dim: int) -> dict[str, Any]:
    return {"t": "kv", "layer": layer, "start": start, "count": count, "dtype": DTYPE_NAMES[dtype],
            "heads": heads, "dim": dim}  # fmt: skip


def kv_frame(layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> list[Any]:
    count, heads, dim = k.shape
    return frame(kv_header(layer, start, count, k.dtype, heads, dim), k, v)


@dataclass(eq=False)
class StagedFrame:
    """A frame ready to write: ``head`` (length prefix and header, small), then the ``payload`` buffers as
    they are. A ``kv`` frame's payload lives in a staging buffer: on a GPU ``ready`` is the event of the copy
    that fills it (wait for it before reading the payload), and ``release`` gives the buffer back once it is
    written (``reuse=False``: something may still read it, e.g. a transport that broke mid-write)."""

    head: bytes
    payload: tuple[memoryview, ...] = ()
    ready: torch.cuda.Event | None = None
    _release: Callable[[bool], None] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, header: dict[str, Any]) -> StagedFrame:
        """A frame without payload (done, error)."""
        return cls(head(header))

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(p.nbytes for p in self.payload)

    def buffers(self) -> list[Any]:
        return [self.head, *self.payload]

    def release(self, *, reuse: bool = True) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(reuse)


def rows_per_frame(k_cache: torch.Tensor, frame_bytes: int) -> int:
    """Positions of one layer a frame of at most ``frame_bytes`` of payload carries (one at least)."""
    heads, dim = k_cache.shape[1:]
    return max(1, frame_bytes // (2 * heads * dim * k_cache.element_size()))


def stage_layer(
    send: Callable[[StagedFrame], None],
    layer: int,
    start: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    buffers: HostBuffers,
    window: SendWindow | None = None,
    frame_bytes: int = 4 << 20,
) -> bool:
    """Stage positions ``start .. start + len(slots)`` of one layer (``slots``: their cache slots, on the
    cache's device) in frames of at most ``frame_bytes`` of payload, and ``send`` each. Each frame takes a
    place in ``window`` first, waiting while the window is full; returns False, sending no more, once the
    window is closed. Never reads the device from the host: no synchronisation with the step."""
    step = rows_per_frame(k_cache, frame_bytes)
    gave = window.give if window is not None else None
    for lo in range(0, slots.shape[0], step):
        if window is not None and not window.take():
            return False
        send(stage_frame(layer, start + lo, k_cache, v_cache, slots[lo : lo + step], buffers, gave))
    return True


@torch.inference_mode()
def stage_frame(
    layer: int,
    start: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    buffers: HostBuffers,
    released: Callable[[], None] | None = None,
    *,
    gather_on_side: bool = False,
) -> StagedFrame:
    """One frame of positions ``start .. start + len(slots)`` of ``layer``, gathered into a staging buffer
    (``released`` is called when the frame is released). On a GPU the gather runs on the current stream
    (ordered after the writes of these slots and before any later reuse of them), or with
    ``gather_on_side`` on the side stream (the caller made it wait for those writes), and the copy to the
    host on the side stream: the frame's ``ready`` event says when it is done."""
    count = int(slots.shape[0])
    _, heads, dim = k_cache.shape
    elements = count * heads * dim
    nbytes = 2 * elements * k_cache.element_size()
    buf = buffers.take(nbytes)
    host = buf[:nbytes].view(k_cache.dtype)
    k_out, v_out = host[:elements].view(count, heads, dim), host[elements:].view(count, heads, dim)
    ready = None
    if k_cache.is_cuda:
        side = side_stream(k_cache.device)
        if gather_on_side:
            with torch.cuda.stream(side):
                k_dev, v_dev = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
        else:
            k_dev, v_dev = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
            side.wait_stream(torch.cuda.current_stream(k_cache.device))
            k_dev.record_stream(side)  # the step's allocator must not hand them out before the copy is done
            v_dev.record_stream(side)
        with torch.cuda.stream(side):
            k_out.copy_(k_dev, non_blocking=True)
            v_out.copy_(v_dev, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(side)
    else:  # the gather is the one copy: straight into the buffer the writer sends
        torch.index_select(k_cache, 0, slots, out=k_out)
        torch.index_select(v_cache, 0, slots, out=v_out)

    def release(reuse: bool) -> None:
        buffers.give(buf, reuse=reuse)
        if released is not None:
            released()

    header = kv_header(layer, start, count, k_cache.dtype, heads, dim)
    return StagedFrame(head(header), (buf.numpy().data[:nbytes],), ready, release)


@dataclass(frozen=True)
class KvChunk:
    layer: int
    start: int
    k: torch.Tensor  # [count, heads, dim]
    v: torch.Tensor


async def read_frame(source: ByteSource) -> KvChunk | dict[str, Any]:
    """The next frame: a KvChunk, or the header of a done/error frame (for tests and tools: the importer
    reads frames into its staging buffers instead)."""
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


def slots_on(slots: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``slots`` on ``device`` without a synchronisation: through page-locked memory to a GPU."""
    if device.type != "cuda":
        return slots
    return slots.pin_memory().to(device, non_blocking=True)
