"""Host memory for K/V on its way between an engine's cache and a socket, and the bounds on it.

A transfer stages K/V in host buffers: the sender gathers a layer's positions into one (on a GPU: a copy on a
side stream into page-locked memory, so nothing waits for it), the writer sends it and gives it back; the
receiver reads the socket into one and scatters it into its cache. ``SendWindow`` bounds the frames of one
transfer in flight, so a slow receiver holds the sender back instead of growing its memory.
"""

from __future__ import annotations

import threading

import torch


class HostBuffers:
    """Reusable staging buffers (uint8). A buffer is reused only once given back, when nobody reads or writes
    its memory any more (the writer gives it back once the kernel holds its bytes); a buffer dropped
    instead (``give(..., reuse=False)``) is freed when its last reference goes. Reuse matters: fresh host
    memory costs a page fault per page on first touch, and page-locked memory a slow driver call."""

    def __init__(self, *, pin: bool = False, keep: int = 16) -> None:
        self.pin = pin
        self.keep = keep
        self._idle: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.outstanding = 0  # taken and not given back: what transfers hold now

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (the smallest idle one that fits, or a new one)."""
        with self._lock:
            self.outstanding += 1
            fits = [b for b in self._idle if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._idle.remove(buf)
                return buf
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, *, reuse: bool = True) -> None:
        with self._lock:
            self.outstanding -= 1
            if not reuse:
                return
            self._idle.append(buf)
            if len(self._idle) > self.keep:
                self._idle.remove(min(self._idle, key=lambda b: b.numel()))


SEND_STALL_TIMEOUT_S = 5.0  # the longest a step waits for room in a window before giving the export up


class SendWindow:
    """At most ``limit`` frames of one transfer in flight between the thread that stages them and the
    writer that sends them. ``take`` blocks the stager until the writer gives one back (backpressure), and
    returns False once the transfer is closed (its receiver left), so nothing waits on a dead transfer. A
    receiver that stops reading holds the sender's step for ``timeout_s`` at most (default
    ``SEND_STALL_TIMEOUT_S``): then the window closes as ``stalled`` and ``take`` returns False."""

    def __init__(self, limit: int, timeout_s: float | None = None) -> None:
        if limit < 1:
            raise ValueError("a send window holds at least one frame")
        self.limit = limit
        self.timeout_s = SEND_STALL_TIMEOUT_S if timeout_s is None else timeout_s
        self._cond = threading.Condition()
        self.in_flight = 0
        self.peak = 0  # the most frames ever in flight at once
        self.closed = False
        self.stalled = False  # closed because no frame was given back for ``timeout_s``

    def take(self) -> bool:
        with self._cond:
            if not self._cond.wait_for(lambda: self.in_flight < self.limit or self.closed, self.timeout_s):
                self.closed = self.stalled = True
                self._cond.notify_all()
            if self.closed:
                return False
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            return True

    def give(self) -> None:
        with self._cond:
            self.in_flight = max(0, self.in_flight - 1)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()


_streams: dict[int, torch.cuda.Stream] = {}
_streams_lock = threading.Lock()


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The CUDA stream KV transfers copy on, one per device: their copies never queue behind a step."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=torch.device("cuda", index))  # type: ignore[no-untyped-call]
        return stream
