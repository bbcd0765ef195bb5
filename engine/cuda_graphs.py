"""CUDA graphs for decode steps: a pure-decode step of at most ``max_batch`` sequences is padded to the next
bucket (1, 2, 4, 8, ... ``max_batch``) and replayed from the graph captured once for that bucket, its inputs
copied into static buffers first; every other step runs eagerly.

A padding row computes token 0 at position 0 of a one-token context whose K/V goes to ``scratch_block``, a
block the block manager never hands out, so no real block is ever written by one. At capture the decode
kernel's split count is fixed for the longest context (``max_blocks`` blocks); shorter contexts leave some
splits empty. Graphs are captured largest first into one shared memory pool (as vLLM does), each after an
eager warm-up run that compiles the Triton kernels. With ``capture=False`` the same padded step runs
eagerly, on any device: how tests check on CPU that padding changes no real row and writes no real block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, KVCache, SeqSlice
from engine.model.llama import CausalLM


def decode_buckets(max_batch: int) -> list[int]:
    """Powers of two below ``max_batch``, then ``max_batch`` itself."""
    buckets = [1]
    while buckets[-1] * 2 < max_batch:
        buckets.append(buckets[-1] * 2)
    if buckets[-1] < max_batch:
        buckets.append(max_batch)
    return buckets


@dataclass(frozen=True)
class _Static:
    """The graphs' inputs: the first ``b`` rows of each serve bucket ``b``."""

    input_ids: torch.Tensor  # [max_batch] long
    positions: torch.Tensor  # [max_batch] long
    slot_mapping: torch.Tensor  # [max_batch] long
    seq_lens: torch.Tensor  # [max_batch] int32
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    query_start: torch.Tensor  # [max_batch + 1] int32: 0, 1, 2, ... (one query per row)
    prefix_lens: torch.Tensor  # [max_batch] int32: seq_lens - 1 (unused by the decode kernel)


class DecodeGraphs:
    """Pads decode steps to their bucket; on CUDA (``capture=True``) replays each bucket's graph."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        *,
        capture: bool,
    ) -> None:
        assert 0 <= scratch_block < kv_cache.num_blocks, "the scratch block must lie in the KV cache"
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.scratch_block = scratch_block
        self.buckets = decode_buckets(max_batch)
        self.max_blocks = max_blocks
        self.capture = capture
        self.replays = 0  # steps served through a bucket (replayed, or run padded when not capturing)
        scratch_slot = scratch_block * self.block_size
        with torch.inference_mode():
            n = self.buckets[-1]
            self.static = _Static(
                input_ids=torch.zeros(n, dtype=torch.long, device=device),
                positions=torch.zeros(n, dtype=torch.long, device=device),
                slot_mapping=torch.full((n,), scratch_slot, dtype=torch.long, device=device),
                seq_lens=torch.ones(n, dtype=torch.int32, device=device),
                block_tables=torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device),
                query_start=torch.arange(n + 1, dtype=torch.int32, device=device),
                prefix_lens=torch.zeros(n, dtype=torch.int32, device=device),
            )
        self._real_rows = 0  # rows 0 .. this hold a real step's inputs (the rest hold padding)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def bucket(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def fits(self, meta: AttentionMetadata) -> bool:
        return (
            meta.is_decode
            and self.bucket(len(meta.query_lens)) is not None
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode step that ``fits``, through its bucket. The result is a view
        of the graph's output: valid until the next step."""
        n = len(meta.query_lens)
        bucket = self.bucket(n)
        assert bucket is not None and meta.is_decode
        self._fill(input_ids, positions, meta)
        self.replays += 1
        if self.capture:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        real = tuple(meta.slices)
        padding = (SeqSlice([self.scratch_block], 0, 1),) * (bucket - n)
        hidden = self._forward(bucket, real + padding, meta.context_lens + (1,) * (bucket - n))
        return hidden[:n]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's rows into the static buffers; rows a larger step left behind back to padding."""
        s, n = self.static, len(meta.query_lens)
        if self._real_rows > n:
            stale = slice(n, self._real_rows)
            s.input_ids[stale] = 0
            s.positions[stale] = 0
            s.slot_mapping[stale] = self.scratch_block * self.block_size
            s.seq_lens[stale] = 1
            s.prefix_lens[stale] = 0
            s.block_tables[stale, 0] = self.scratch_block
        self._real_rows = n
        s.input_ids[:n].copy_(input_ids, non_blocking=True)
        s.positions[:n].copy_(positions, non_blocking=True)
        s.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        s.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        torch.sub(s.seq_lens[:n], 1, out=s.prefix_lens[:n])
        # Entries past a row's context are never read: a shorter table leaves the rest as it was.
        s.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)

    def _forward(
        self, bucket: int, slices: tuple[SeqSlice, ...], context_lens: tuple[int, ...]
    ) -> torch.Tensor:
        s = self.static
        meta = AttentionMetadata(
            slices=slices,
            device=self.device,
            block_size=self.block_size,
            query_lens=(1,) * bucket,
            context_lens=context_lens,
            slot_mapping=s.slot_mapping[:bucket],
            block_tables=s.block_tables[:bucket],
            seq_lens=s.seq_lens[:bucket],
            query_start=s.query_start[: bucket + 1],
            prefix_lens=s.prefix_lens[:bucket],
        )
        hidden: torch.Tensor = self.model(s.input_ids[:bucket], s.positions[:bucket], self.kv_cache, meta)
        return hidden

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """One graph per bucket, largest first, all in one memory pool. Every row is padding while
        capturing: only the scratch block is written."""
        self._real_rows = 0
        longest = self.max_blocks * self.block_size  # fixes the decode kernel's split count
        pool = None
        for bucket in reversed(self.buckets):
            slices = (SeqSlice([self.scratch_block], 0, 1),) * bucket
            for _ in range(2):  # warm-up: compiles the kernels, initialises cuBLAS outside the capture
                self._forward(bucket, slices, (longest,) * bucket)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket, slices, (longest,) * bucket)
            pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
