"""The receiving side of a KV transfer: fetch positions ``start .. end`` of a prompt from another engine and
write them straight into the blocks already reserved for the sequence.

Two sources, one wire format (``engine.kv_transfer``): a prefill engine computes the positions and streams
them (``/v1/kv/prefill``, disaggregation), or a peer engine sends what its prefix cache already holds
(``/v1/kv/cached``, a KV pull), which may be fewer positions than asked for.

A transfer runs on a worker thread, never on the event loop: it reads each frame's payload from the socket
into a staging buffer (``engine.kv_client``: the kernel's copy is the only one) and scatters it into the
blocks (on a GPU: from page-locked memory, asynchronously, on a side stream, the next read overlapping the
copy). Only those blocks are written, and no running sequence uses them yet, so the engine thread keeps
stepping meanwhile. A fetch returns (or raises) only once nothing more will be written into the blocks (on
a GPU: once its copies are done), so the sequence that owns them can compute, or give them back, at once.
Anything short of every layer of every position the source announced ends in KvTransferError; the caller
then frees the reservation (prefill) or computes the positions itself (pull).
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urljoin

import numpy as np
import orjson
import torch

from engine.attention import KVCache
from engine.engine_types import ImportTicket
from engine.kv_client import HttpBodyReader
from engine.kv_source_request import kv_source_body
from engine.kv_staging import HostBuffers, side_stream
from engine.kv_transfer import DTYPES, KvTransferError, position_slots, slots_on
from engine.kv_wire import LENGTH_BYTES, header_length, parse_header, payload_bytes
from engine.sequence import CacheNamespace

MAX_REDIRECTS = 3


class KvImporter:
    def __init__(
        self,
        kv_cache: KVCache,
        model_name: str,
        *,
        timeout_s: float = 600.0,
        pull_timeout_s: float = 60.0,
        piece_bytes: int = 1 << 20,
        max_transfers: int = 32,
    ) -> None:
        self.kv_cache = kv_cache
        self.model_name = model_name
        self.timeout_s = timeout_s
        # A pull computes nothing at the source, so it should finish quickly; one that hangs would hold its
        # request back for nothing, since the positions can always be computed here instead.
        self.pull_timeout_s = pull_timeout_s
        # Staged at a time: small enough to stay in the CPU's cache between the read and the scatter.
        self.piece_bytes = piece_bytes
        self.buffers = HostBuffers(pin=kv_cache.k[0].is_cuda)
        self._workers = ThreadPoolExecutor(max_transfers, thread_name_prefix="kvgate-kv-import")
        self.bytes_received = 0

    async def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """Have a prefill engine compute the positions and store them; returns the tokens the prefill engine
        found in its own cache."""
        done = await self._fetch(f"{source_url}/v1/kv/prefill", ticket, namespace, self.timeout_s)
        if done["tokens"] != ticket.end:
            raise KvTransferError(f"the prefill engine sent {done['tokens']} of {ticket.end} positions")
        return done["cached_tokens"]

    async def pull(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """Pull the positions from a peer's prefix cache and store them; returns the end of those stored
        (from ``ticket.start``, all of them, up to ``ticket.end``: the peer may have evicted the rest)."""
        done = await self._fetch(f"{source_url}/v1/kv/cached", ticket, namespace, self.pull_timeout_s)
        return done["tokens"]

    async def _fetch(
        self, url: str, ticket: ImportTicket, namespace: CacheNamespace, timeout_s: float
    ) -> dict[str, int]:
        body = kv_source_body(
            model=self.model_name,
            block_size=self.kv_cache.block_size,
            request_id=ticket.request_id,
            prompt_token_ids=ticket.prompt_token_ids[: ticket.end],
            from_position=ticket.start,
            cache_salt=namespace.salt,
            cache_shared_blocks=namespace.shared_blocks,
        )
        transfer = _Transfer(self, url, orjson.dumps(body), timeout_s, ticket)
        running = asyncio.get_running_loop().run_in_executor(self._workers, transfer.run)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(running)
        except TimeoutError:
            raise KvTransferError(f"KV transfer from {url} took over {timeout_s:g} s") from None
        finally:
            if not running.done():  # timed out or cancelled: stop the worker, and wait until it has
                transfer.abort()
                await _settled(running)
            self.bytes_received += transfer.bytes


async def _settled(running: asyncio.Future[Any]) -> None:
    """Wait for ``running`` to end, cancelled or not: the blocks it writes must not change hands before."""
    cancelled = False
    while not running.done():
        try:
            await asyncio.wait([running])
        except asyncio.CancelledError:
            cancelled = True
    if not running.cancelled():
        running.exception()  # retrieved: its failure is the abort's, nothing to report
    if cancelled:
        raise asyncio.CancelledError


class _Transfer:
    """One fetch, on its worker thread: the HTTP exchange (following a 307/308 redirect with the same body:
    an engine whose cache is in an engine core process sends there), then frames into the ticket's blocks."""

    def __init__(
        self, importer: KvImporter, url: str, body: bytes, timeout_s: float, ticket: ImportTicket
    ) -> None:
        self.importer = importer
        self.body, self.timeout_s = body, timeout_s
        self.conn = HttpBodyReader(url, body, timeout_s=timeout_s)
        self.aborted = False
        self.ticket = ticket
        self.bytes = 0
        cache = importer.kv_cache
        self.device = cache.k[0].device
        self.stream = side_stream(self.device) if self.device.type == "cuda" else None

    def abort(self) -> None:
        """Make the worker's exchange fail now (from any thread), a redirected one too."""
        self.aborted = True
        self.conn.abort()

    def run(self) -> dict[str, int]:
        url = self.conn.url
        try:
            with torch.inference_mode():
                status = self.conn.open()
                for _ in range(MAX_REDIRECTS):
                    location = self.conn.headers.get("location")
                    if status not in (307, 308) or not location:
                        break
                    self.conn.close()
                    url = urljoin(url, location)
                    self.conn = HttpBodyReader(url, self.body, timeout_s=self.timeout_s)
                    if self.aborted:
                        self.conn.abort()
                    status = self.conn.open()
                if status != 200:
                    raise KvTransferError(f"{url} answered {status}: {self.conn.read_text(4096)[:300]}")
                return self._receive()
        except OSError as exc:
            raise KvTransferError(f"KV transfer from {url} broke: {exc or type(exc).__name__}") from None
        finally:
            self.conn.close()

    def _receive(self) -> dict[str, int]:
        """Store frames until the done frame; returns its ``tokens`` and ``cached_tokens``, having checked
        that every layer received exactly positions ``ticket.start .. tokens``."""
        cache, ticket, conn = self.importer.kv_cache, self.ticket, self.conn
        expected = ticket.end - ticket.start
        received = [0] * len(cache.k)  # each layer's positions arrive in order: ticket.start + received
        stage = _Staging(self.importer, self.stream)
        try:
            with stage.on_stream():
                # Queued before the block table's previous owners' work is done? The side stream waits.
                slots = slots_on(
                    position_slots(ticket.block_table, cache.block_size, ticket.start, ticket.end),
                    self.device,
                )
            while True:
                header = parse_header(conn.read_exact(header_length(conn.read_exact(LENGTH_BYTES))))
                if header["t"] == "done":
                    return _done(header, ticket, received)
                if header["t"] == "error":
                    raise KvTransferError(f"the source engine failed: {header.get('message')}")
                layer, count = header["layer"], header["count"]
                lo, hi = header["start"] - ticket.start, header["start"] - ticket.start + count
                if not (0 <= layer < len(cache.k) and lo == received[layer] and hi <= expected):
                    raise KvTransferError(
                        f"frame for layer {layer}, positions {header['start']}+{count} out of order or range"
                    )
                shape = (count, header["heads"], header["dim"])
                if shape[1:] != tuple(cache.k[layer].shape[1:]):
                    raise KvTransferError(f"frame shape {shape} does not fit this engine's cache")
                dtype = DTYPES[header["dtype"]]
                for target in (cache.k[layer], cache.v[layer]):  # the payload: K, then V
                    stage.read_rows(conn, target, slots[lo:hi], dtype)
                received[layer] = hi
                self.bytes += payload_bytes(header)
        finally:
            stage.finish()


class _Staging:
    """Staging buffers of one transfer: socket -> buffer -> blocks, piece by piece. On a GPU two page-locked
    buffers take turns, so the next piece is read while the last one is copied; a buffer is read into again
    only once its copy is done."""

    def __init__(self, importer: KvImporter, stream: torch.cuda.Stream | None) -> None:
        self.importer = importer
        self.stream = stream
        ring = 2 if stream is not None else 1
        self.bufs = [importer.buffers.take(importer.piece_bytes) for _ in range(ring)]
        self.copied: list[torch.cuda.Event | None] = [None] * ring
        self.turn = 0
        if stream is not None:
            stream.wait_stream(torch.cuda.default_stream(stream.device))

    def on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def read_rows(
        self, conn: HttpBodyReader, target: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """Read ``len(slots)`` rows of ``dtype`` from ``conn`` and store them in ``target``'s ``slots``."""
        row_bytes = target[0].numel() * dtype.itemsize
        per_piece = max(1, self.importer.piece_bytes // row_bytes)
        for r0 in range(0, slots.shape[0], per_piece):
            rows = min(per_piece, slots.shape[0] - r0)
            nbytes = rows * row_bytes
            i, self.turn = self.turn, (self.turn + 1) % len(self.bufs)
            buf = self.bufs[i]
            if buf.numel() < nbytes:  # one row over the piece size
                self.importer.buffers.give(buf, reuse=False)
                buf = self.bufs[i] = self.importer.buffers.take(nbytes)
            copied = self.copied[i]
            if copied is not None:
                copied.synchronize()  # this worker waits, nobody else
            conn.readinto(buf.numpy().data[:nbytes])
            if self.stream is None and dtype == target.dtype:
                # numpy scatters whole rows (a memcpy each, without the GIL), torch's index_copy_ element by
                # element: 4-5x slower on a CPU.
                _rows(target)[slots[r0 : r0 + rows].numpy()] = _rows(buf[:nbytes].view(rows, -1))
                continue
            rows_in = buf[:nbytes].view(dtype).view(rows, *target.shape[1:])
            if self.stream is None:
                target.index_copy_(0, slots[r0 : r0 + rows], rows_in.to(target.dtype))
                continue
            with torch.cuda.stream(self.stream):
                on_device = rows_in.to(target.device, non_blocking=True)
                target.index_copy_(0, slots[r0 : r0 + rows], on_device.to(target.dtype))
                event = self.copied[i] = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(self.stream)

    def finish(self) -> None:
        """Wait for the copies still running (on a GPU), then give the buffers back."""
        reuse = True
        if self.stream is not None:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self.stream)
            try:
                done.synchronize()
            except RuntimeError:
                reuse = False  # the device failed: the buffers may still be in use
        for buf in self.bufs:
            self.importer.buffers.give(buf, reuse=reuse)


def _rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's first dimension as a numpy vector of opaque rows (any dtype, bf16 too)."""
    flat = t.view(torch.uint8).view(t.shape[0], -1).numpy()
    return flat.view(np.dtype((np.void, flat.shape[1]))).reshape(-1)


def _done(header: dict[str, Any], ticket: ImportTicket, received: list[int]) -> dict[str, int]:
    """The done frame's counts, once every layer holds every position it announces."""
    try:
        tokens, cached = int(header.get("tokens", ticket.end)), int(header.get("cached_tokens", 0))
    except (TypeError, ValueError):
        raise KvTransferError(f"malformed done frame {header!r}") from None
    if not ticket.start <= tokens <= ticket.end:
        raise KvTransferError(f"the source announced {tokens} positions of {ticket.start}..{ticket.end}")
    if any(r != tokens - ticket.start for r in received):
        raise KvTransferError(
            f"transfer ended with {min(received)} of {tokens - ticket.start} positions in some layer"
        )
    return {"tokens": tokens, "cached_tokens": cached}
