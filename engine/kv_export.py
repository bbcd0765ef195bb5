"""The sending engine's side of a KV transfer: which K/V goes out, and when.

During a step the model runner calls ``on_layer(i)`` after layer ``i`` stored its K/V; every exporting
sequence in the batch then stages that layer for the positions this step computed (and, on its first step,
the positions its own prefix cache already held). Staging is one gather into a host buffer the writer sends
as it is; on a GPU it is queued on the streams and nothing here waits for the device (no ``.cpu()``,
``.item()``, ``.tolist()``). What may wait is the sink's window: a receiver slower than the engine holds the
step back, frame by frame, rather than letting staged K/V pile up; a closed window (the receiver left)
stops the sink's frames at once. A receiver that takes nothing for the window's timeout (a few seconds)
stalls the step no longer: its export is closed with an error frame and aborted after the step.

Cached positions (a peer's KV pull, an export whose every position was cached) need no step: the engine
holds their blocks (``PinnedRun``) and the writer stages them frame by frame at the receiver's pace, off
the engine thread; on a CPU a frame is the cache's own memory, sent without any copy. Where the sink takes
no pinned runs, ``send_positions`` stages them on the engine thread instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention import KVCache
from engine.kv_staging import HostBuffers, SendWindow, side_stream
from engine.kv_transfer import (
    StagedFrame,
    kv_header,
    position_slots,
    rows_per_frame,
    slots_on,
    stage_frame,
    stage_layer,
)
from engine.kv_wire import head
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


@dataclass(eq=False)
class ExportSink:
    """Where one sequence's frames go: ``send`` takes a staged frame (whoever writes it calls its
    ``release`` once written), ``close`` the final header; both are called on the engine thread and must not
    block. ``window`` bounds the frames in flight (None: unbounded, the caller's business); the engine
    sets ``buffers`` (its staging buffers) when it takes the sink."""

    send: Callable[[StagedFrame], None]
    close: Callable[[dict[str, Any]], None]
    window: SendWindow | None = None
    # Takes cached positions as a PinnedRun its writer stages (None: the engine stages them at once)...
    send_run: Callable[[PinnedRun], None] | None = None
    # ...and, once a run's blocks may go back, has the engine thread call ``run_kv_unpins`` soon.
    wake: Callable[[], None] | None = None
    buffers: HostBuffers | None = None
    frame_bytes: int = 4 << 20  # payload of one frame at most: a layer of a long prompt goes in several
    sent_positions: int = 0
    stopped: bool = False  # the window was closed: nothing more is staged
    stalled: bool = False  # ...because the receiver stopped reading: the sink was closed with an error

    def stage(
        self, layer: int, start: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Stage and send positions ``start .. start + len(slots)`` of ``layer`` (``slots`` on the device)."""
        if self.stopped:
            return
        if self.buffers is None:
            self.buffers = HostBuffers(pin=k_cache.is_cuda)
        sent = stage_layer(
            self.send, layer, start, k_cache, v_cache, slots,
            buffers=self.buffers, window=self.window, frame_bytes=self.frame_bytes,
        )  # fmt: skip
        self.stopped = not sent
        if self.stopped and self.window is not None and self.window.stalled and not self.stalled:
            self.stalled = True  # the engine aborts the export after this step
            seconds = f"{self.window.timeout_s:g}"
            self.close({"t": "error", "message": f"the receiving engine took no K/V for {seconds} s"})


@dataclass(frozen=True)
class _Plan:
    sink: ExportSink
    start: int
    slots: torch.Tensor  # on the host


def plan_exports(batch: list[ScheduledSeq], block_size: int) -> list[_Plan]:
    """For each exporting sequence: the positions whose K/V leave after each layer of this step."""
    plans = []
    for item in batch:
        seq = item.seq
        if seq.export is None:
            continue
        end = seq.num_computed + item.num_new
        start = max(seq.export_from, seq.export.sent_positions)
        if end > start:
            plans.append(_Plan(seq.export, start, position_slots(seq.block_table, block_size, start, end)))
            seq.export.sent_positions = end
    return plans


def layer_sender(plans: list[_Plan], kv_cache: KVCache) -> Callable[[int], None]:
    """The hook the forward pass calls after each layer: it only queues work (a gather into a staging
    buffer; on a GPU, copies on the streams) and hands the frames on."""
    device = kv_cache.k[0].device
    slots = [slots_on(plan.slots, device) for plan in plans]  # once per step, not per layer

    def on_layer(i: int) -> None:
        k_cache, v_cache = kv_cache.layer(i)
        for plan, plan_slots in zip(plans, slots, strict=True):
            plan.sink.stage(i, plan.start, k_cache, v_cache, plan_slots)

    return on_layer


def send_cached(seq: Sequence, kv_cache: KVCache) -> None:
    """Every layer of positions ``export_from`` on, straight from the cache (nothing left to compute)."""
    assert seq.export is not None
    start, end = max(seq.export_from, seq.export.sent_positions), seq.num_computed
    if end <= start:
        return
    send_positions(seq.export, kv_cache, seq.block_table, start, end)
    seq.export.sent_positions = end


def send_positions(sink: ExportSink, kv_cache: KVCache, block_table: list[int], start: int, end: int) -> None:
    """Every layer of positions ``start .. end`` of the blocks ``block_table``, layer after layer. Staging
    copies the K/V out now, on the engine thread: the blocks may be reused as soon as the engine steps on
    (on a GPU the gathers are queued before any later step's writes)."""
    slots = slots_on(position_slots(block_table, kv_cache.block_size, start, end), kv_cache.k[0].device)
    for i in range(len(kv_cache.k)):
        k_cache, v_cache = kv_cache.layer(i)
        sink.stage(i, start, k_cache, v_cache, slots)


# A frame of cached positions is sent from the cache's own memory when its runs of consecutive slots average
# this much at least; below, a write per run costs more than gathering them into a staging buffer. A writer
# with vectored writes (``PinnedRun.vectored``: one system call for many buffers) takes far shorter runs.
IN_PLACE_RUN_BYTES = 256 << 10
IN_PLACE_RUN_BYTES_VECTORED = 8 << 10


class PinnedRun:
    """Positions ``start ..`` of cached blocks (``slots``, on the host) held for one transfer: the engine
    holds a reference to each block, so no step evicts or rewrites them, and the writer's side stages
    frames as it goes (``next_frame``, from any thread), never the engine. On a CPU a frame's payload is the
    cache's own memory, runs of consecutive slots sent without a copy (gathered into a staging buffer when
    the runs are short); on a GPU it is gathered and copied to page-locked memory on the side stream. Once
    ``close`` is called and every frame taken is released, ``unpin`` gives the blocks back (it must hand
    the work to the engine thread)."""

    def __init__(
        self,
        kv_cache: KVCache,
        slots: torch.Tensor,
        start: int,
        *,
        frame_bytes: int,
        buffers: HostBuffers,
        unpin: Callable[[], None],
    ) -> None:
        self.kv_cache = kv_cache
        self.start = start
        self.buffers = buffers
        self._slots = slots
        self._rows = rows_per_frame(kv_cache.k[0], frame_bytes)
        self._layer = 0
        self._lo = 0
        self._lock = threading.Lock()
        self._taken = 0  # frames out and not yet released
        self._closed = False
        self._unpin: Callable[[], None] | None = unpin
        self.vectored = False  # the writer sends many buffers in one system call (set before the frames)
        device = kv_cache.k[0].device
        self._device_slots: torch.Tensor | None = None
        if device.type == "cuda":  # on the engine thread: the side stream waits for every step queued so far
            self._device_slots = slots_on(slots, device)
            written = torch.cuda.Event()  # type: ignore[no-untyped-call]
            written.record(torch.cuda.current_stream(device))
            side_stream(device).wait_event(written)

    @property
    def positions(self) -> int:
        return int(self._slots.shape[0])

    def next_frame(self) -> StagedFrame | None:
        """The next frame (layer by layer, in position order), or None once all are out or it is closed."""
        with self._lock:
            if self._closed or self._layer >= len(self.kv_cache.k):
                return None
            layer, lo = self._layer, self._lo
            hi = min(lo + self._rows, self.positions)
            self._layer, self._lo = (layer + 1, 0) if hi == self.positions else (layer, hi)
            self._taken += 1
        try:
            return self._frame(layer, lo, hi)
        except BaseException:
            self._released()  # no frame came of it
            raise

    def _frame(self, layer: int, lo: int, hi: int) -> StagedFrame:
        k_cache, v_cache = self.kv_cache.layer(layer)
        if self._device_slots is not None:
            on_device = self._device_slots[lo:hi]
            start = self.start + lo
            return stage_frame(
                layer, start, k_cache, v_cache, on_device, self.buffers, self._released, gather_on_side=True
            )
        slots = self._slots[lo:hi].numpy()
        breaks = np.flatnonzero(np.diff(slots) != 1) + 1
        least = IN_PLACE_RUN_BYTES_VECTORED if self.vectored else IN_PLACE_RUN_BYTES
        if (hi - lo) * k_cache[0].nbytes < least * (len(breaks) + 1):
            # Scattered blocks: a write per run would cost more than one gather into a staging buffer.
            rows = self._slots[lo:hi]
            return stage_frame(layer, self.start + lo, k_cache, v_cache, rows, self.buffers, self._released)
        return self._in_place(layer, lo, hi, slots, breaks, k_cache, v_cache)

    @torch.inference_mode()
    def _in_place(
        self,
        layer: int,
        lo: int,
        hi: int,
        slots: np.ndarray,
        breaks: np.ndarray,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> StagedFrame:
        firsts = slots[np.concatenate(([0], breaks))].tolist()
        counts = np.diff(np.concatenate(([0], breaks, [len(slots)]))).tolist()
        payload = []
        for cache in (k_cache, v_cache):  # K's rows, then V's
            rows = cache.view(torch.uint8).view(cache.shape[0], -1).numpy()
            payload += [rows[a : a + n].data.cast("B") for a, n in zip(firsts, counts, strict=True)]
        _, heads, dim = k_cache.shape
        header = kv_header(layer, self.start + lo, hi - lo, k_cache.dtype, heads, dim)
        return StagedFrame(head(header), tuple(payload), None, lambda reuse: self._released())

    def close(self) -> None:
        """No more frames will be taken; the blocks go back once the ones taken are released."""
        with self._lock:
            self._closed = True
        self._maybe_unpin()

    def _released(self) -> None:
        with self._lock:
            self._taken -= 1
        self._maybe_unpin()

    def _maybe_unpin(self) -> None:
        with self._lock:
            unpin = self._unpin if self._closed and self._taken == 0 else None
            if unpin is not None:
                self._unpin = None
        if unpin is not None:
            unpin()
