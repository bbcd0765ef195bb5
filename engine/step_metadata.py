"""Each step's attention metadata from persistent state (see ``engine.attention``): a block table row per
running sequence, kept on the device and written only where a sequence was admitted or gained blocks, and on
CUDA every per-step array staged in pinned host memory and copied without blocking. ``build_metadata``
rebuilds the whole table from Python lists each step; this builds the same metadata without doing so."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.attention import AttentionMetadata, MixedSplit, SeqSlice, check_step, split_rows


class StepMetadata:
    """Builds each step's ``AttentionMetadata`` from a persistent block table: row ``r`` holds the blocks of
    one sequence, written when it is admitted (its block list is a new list: first admission, or again
    after preemption freed it) and extended when it grows. Rows of sequences that left are reused, least
    recently used first, once no row is free; nothing has to be told about a finish. On CUDA the table
    lives on the device and each step's arrays go through pinned buffers with non-blocking copies."""

    def __init__(
        self,
        block_size: int,
        device: torch.device | str = "cpu",
        max_num_seqs: int = 64,
        max_blocks: int = 16,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        self.staged = self.device.type == "cuda"
        self.host = np.zeros((max(1, max_num_seqs), max(1, max_blocks)), dtype=np.int32)  # the table
        self.table = self._device_table()  # on CPU the same memory as ``host``
        self.rows: dict[int, tuple[object, list[int], int]] = {}  # id(owner) -> (owner, its block list, row)
        self.free = list(range(self.host.shape[0] - 1, -1, -1))
        self.written = np.zeros(self.host.shape[0], dtype=np.int64)  # blocks of each row written so far
        self._done: torch.cuda.Event | None = None  # the last step's copies out of the pinned buffers
        self._pinned: dict[str, torch.Tensor] = {}

    def _device_table(self) -> torch.Tensor:
        table = torch.from_numpy(self.host)
        return table.to(self.device) if self.staged else table

    def release(self, owner: object) -> None:
        """Give up ``owner``'s row now (optional: a full table reuses the least recently used rows)."""
        entry = self.rows.pop(id(owner), None)
        if entry is not None:
            self.free.append(entry[2])

    def rows_for(self, seqs: Sequence[tuple[object, list[int]]]) -> np.ndarray:
        """The row of each (owner, live block list), its row brought up to date; on CUDA the changed rows
        are copied to the device table."""
        if len(seqs) > self.host.shape[0]:
            self._resize(len(seqs), self.host.shape[1])
        widest = max(len(blocks) for _, blocks in seqs)
        if widest > self.host.shape[1]:
            self._resize(self.host.shape[0], max(widest, 2 * self.host.shape[1]))
        rows = np.empty(len(seqs), dtype=np.int64)
        dirty: list[int] = []
        in_step = {id(owner) for owner, _ in seqs}
        for i, (owner, blocks) in enumerate(seqs):
            key = id(owner)
            entry = self.rows.pop(key, None)  # popped and put back: the dict's order is recency
            if entry is None or entry[1] is not blocks:
                row = entry[2] if entry is not None else self._take(in_step)
                old = int(self.written[row])
                self.host[row, : len(blocks)] = blocks
                self.host[row, len(blocks) : max(old, len(blocks))] = (
                    0  # a reused row reads block 0 past its end
                )
                self.written[row] = len(blocks)
                dirty.append(row)
            else:
                row = entry[2]
                done = int(self.written[row])
                if len(blocks) > done:  # grown since the last step: only the new blocks
                    self.host[row, done : len(blocks)] = blocks[done:]
                    self.written[row] = len(blocks)
                    dirty.append(row)
            self.rows[key] = (owner, blocks, row)  # holds the owner: its id is not reused meanwhile
            rows[i] = row
        if self.staged and dirty:
            self._wait()
            index = np.asarray(dirty, dtype=np.int64)
            staged = self._stage("rows", self.host[index])
            where = self._stage("row_ids", index).to(torch.long)
            self.table.index_copy_(0, where, staged)
        return rows

    def _take(self, in_step: set[int]) -> int:
        if self.free:
            return self.free.pop()
        for key, (_, _, row) in self.rows.items():  # oldest use first
            if key not in in_step:
                del self.rows[key]
                return row
        raise AssertionError("the table is sized for every sequence of the step")  # _resize saw to it

    def _resize(self, num_rows: int, num_blocks: int) -> None:
        self._wait()
        host = np.zeros((max(num_rows, self.host.shape[0]), num_blocks), dtype=np.int32)
        host[: self.host.shape[0], : self.host.shape[1]] = self.host
        self.free.extend(range(host.shape[0] - 1, self.host.shape[0] - 1, -1))
        written = np.zeros(host.shape[0], dtype=np.int64)
        written[: self.written.shape[0]] = self.written
        self.host, self.written = host, written
        self.table = self._device_table()

    def _wait(self) -> None:
        """The pinned buffers are rewritten only once the copies out of them are done."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def _stage(self, name: str, values: np.ndarray) -> torch.Tensor:
        """``values`` on the device: on CUDA through a reused pinned buffer, one non-blocking copy."""
        if not self.staged:
            return torch.from_numpy(values)
        flat = values.reshape(-1)
        dtype = torch.from_numpy(flat[:0]).dtype
        buffer = self._pinned.get(name)
        if buffer is None or buffer.numel() < flat.size or buffer.dtype != dtype:
            buffer = torch.empty(max(flat.size, 1024), dtype=dtype, pin_memory=True)
            self._pinned[name] = buffer
        host = buffer[: flat.size]
        host.numpy()[:] = flat
        out = host.to(self.device, non_blocking=True).view(values.shape)
        return out

    def build(
        self, seqs: Sequence[tuple[object, list[int], int, int]], token_ids: np.ndarray | None = None
    ) -> tuple[AttentionMetadata, torch.Tensor | None, torch.Tensor]:
        """Metadata for (owner, live block list, tokens cached, new tokens) per sequence; with ``token_ids``
        [T] those on the device too. -> (metadata, token ids or None, positions [T] long)."""
        if not seqs:
            raise ValueError("a step needs at least one sequence")
        count = len(seqs)
        num_new = np.fromiter((s[3] for s in seqs), dtype=np.int64, count=count)
        num_computed = np.fromiter((s[2] for s in seqs), dtype=np.int64, count=count)
        num_blocks = np.fromiter((len(s[1]) for s in seqs), dtype=np.int64, count=count)
        ctx = num_computed + num_new
        check_step(num_new, ctx, num_blocks, self.block_size)
        self._wait()
        rows = self.rows_for([(s[0], s[1]) for s in seqs])
        starts = np.concatenate(([0], np.cumsum(num_new)))
        seq = np.repeat(np.arange(count), num_new)
        pos = np.arange(starts[-1]) - starts[seq] + num_computed[seq]
        block = self.block_size
        slots = self.host[rows[seq], pos // block].astype(np.int64) * block + pos % block
        widest = int(num_blocks.max())
        split = split_rows(num_new)
        dec, pre = split if split is not None else (pos[:0], pos[:0])
        # One copy for each dtype: [ctx, starts, prefix, decode ctx] and [slots, pos, rows, ids, decode
        # rows, decode table rows, prefill seqs]
        lens = np.concatenate((ctx, starts, num_computed, ctx[dec])).astype(np.int32)
        ids = token_ids if token_ids is not None else pos[:0]
        longs = np.concatenate((slots, pos, rows, ids, starts[dec], rows[dec], pre))
        staged_longs, staged_lens = self._stage("longs", longs), self._stage("lens", lens)
        if self.staged:
            self._done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._done.record()
        t = int(starts[-1])
        row_index = staged_longs[2 * t : 2 * t + count]
        if self.staged:
            tables = self.table.index_select(0, row_index)[:, :widest]
        else:
            tables = torch.from_numpy(self.host[rows, :widest])
        mixed = None
        if split is not None:
            at, nd = 2 * t + count + len(ids), len(dec)
            decode_table_rows = staged_longs[at + nd : at + 2 * nd]
            if self.staged:
                decode_tables = self.table.index_select(0, decode_table_rows)[:, :widest]
            else:
                decode_tables = torch.from_numpy(self.host[rows[dec], :widest])
            mixed = MixedSplit(
                decode_rows=staged_longs[at : at + nd],
                decode_tables=decode_tables,
                decode_seq_lens=staged_lens[3 * count + 1 :],
                decode_max_context=int(ctx[dec].max()),
                prefill_seqs=staged_longs[at + 2 * nd :],
                prefill_max_query=int(num_new[pre].max()),
            )
        meta = AttentionMetadata(
            slices=tuple(SeqSlice(s[1], s[2], s[3]) for s in seqs),
            device=self.device,
            block_size=block,
            query_lens=tuple(num_new.tolist()),
            context_lens=tuple(ctx.tolist()),
            slot_mapping=staged_longs[:t],
            block_tables=tables,
            seq_lens=staged_lens[:count],
            query_start=staged_lens[count : 2 * count + 1],
            prefix_lens=staged_lens[2 * count + 1 : 3 * count + 1],
            mixed=mixed,
        )
        staged_ids = staged_longs[2 * t + count : 2 * t + count + len(ids)] if token_ids is not None else None
        return meta, staged_ids, staged_longs[t : 2 * t]
