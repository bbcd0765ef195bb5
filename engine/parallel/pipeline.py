"""Pipeline stages: a step's sequences cut into micro-batches that flow stage to stage.

The driver cuts a step into at most ``pp`` micro-batches of whole sequences (contiguous in batch order, about
equal in tokens), none smaller than ``min_tokens``: each micro-batch reads all of a stage's weights again,
which a decode step of a few tokens pays in full and no overlap wins back. Stage 0 embeds micro-batch 0,
sends its hidden states on (without waiting for them to be received) and starts micro-batch 1 while stage 1
works on micro-batch 0, and so on; the last stage returns the logits of the rows that sample, micro-batch
after micro-batch, which is batch order again. Sequences never attend across micro-batches, so the cut
changes no token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.attention import KVCache, SeqSlice, build_metadata
from engine.model.llama import CausalLM
from engine.parallel.distributed import ParallelConfig, RankPlacement
from engine.scheduler import ScheduledSeq


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The tokens of some whole sequences of one step, flattened, as the model takes them."""

    token_ids: list[int]
    positions: list[int]
    slices: list[SeqSlice]
    sample_rows: list[int]  # rows whose next-token logits are wanted, in order

    @classmethod
    def of(cls, items: Sequence[ScheduledSeq]) -> MicroBatch:
        ids: list[int] = []
        positions: list[int] = []
        slices: list[SeqSlice] = []
        sample_rows: list[int] = []
        for item in items:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_new
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slices.append(SeqSlice(list(seq.block_table), start, item.num_new))
            if item.samples:
                sample_rows.append(len(ids) - 1)
        return cls(ids, positions, slices, sample_rows)


def split_micro_batches(
    batch: Sequence[ScheduledSeq], n: int, min_tokens: int = 1
) -> list[list[ScheduledSeq]]:
    """At most ``n`` non-empty groups of consecutive sequences (fewer when the step has fewer than
    ``n * min_tokens`` tokens), cut where the tokens so far reach the next ``1/n`` of the step's tokens."""
    total = sum(item.num_new for item in batch)
    n = max(1, min(n, len(batch), total // max(1, min_tokens)))
    groups: list[list[ScheduledSeq]] = []
    current: list[ScheduledSeq] = []
    done = 0
    for i, item in enumerate(batch):
        current.append(item)
        done += item.num_new
        items_left, groups_left = len(batch) - i - 1, n - len(groups) - 1
        reached = done * n >= total * (len(groups) + 1)
        if groups_left and items_left >= groups_left and (reached or items_left == groups_left):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


def plan_step(batch: Sequence[ScheduledSeq], num_micro_batches: int, min_tokens: int = 1) -> list[MicroBatch]:
    return [MicroBatch.of(g) for g in split_micro_batches(batch, num_micro_batches, min_tokens)]


class PipelineStage:
    """One rank's part of every step: its layers, its shard, its KV cache (its layers, its KV heads)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        placement: RankPlacement,
        parallel: ParallelConfig,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.placement = placement
        self.device = device
        self.hidden_size = model.config.hidden_size
        self.dtype = next(model.parameters()).dtype
        stage, tp_rank = placement.pp_rank, placement.tp.rank
        self.prev_rank = parallel.rank(stage - 1, tp_rank) if not placement.is_first_stage else None
        self.next_rank = parallel.rank(stage + 1, tp_rank) if not placement.is_last_stage else None

    @torch.inference_mode()
    def run(self, plan: list[MicroBatch]) -> torch.Tensor | None:
        """Run every micro-batch through this stage. The last stage's first tensor-parallel rank returns
        float32 logits [N, vocab] for the sampled rows of all micro-batches; every other rank None (its
        tensor-parallel peers hold the same logits: one copy goes back to the driver)."""
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        for mb in plan:
            meta = build_metadata(mb.slices, self.kv_cache.block_size, self.device)
            ids = torch.as_tensor(mb.token_ids, dtype=torch.long, device=self.device)
            positions = torch.as_tensor(mb.positions, dtype=torch.long, device=self.device)
            hidden_in = None
            if self.prev_rank is not None:
                hidden_in = torch.empty(len(ids), self.hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(hidden_in, src=self.prev_rank)
            hidden = self.model(ids, positions, self.kv_cache, meta, hidden_in)  # [T, hidden]
            if self.next_rank is not None:
                out = hidden.contiguous()
                # isend: start the next micro-batch while the next stage receives this one.
                work = dist.isend(out, dst=self.next_rank)
                assert work is not None
                sends.append((work, out))  # keeps the tensor alive until it has been sent
            elif mb.sample_rows:
                rows = torch.as_tensor(mb.sample_rows, dtype=torch.long, device=self.device)
                logits.append(self.model.compute_logits(hidden[rows]))
        for work, _ in sends:
            work.wait()
        if self.next_rank is not None or self.placement.tp.rank != 0:
            return None
        if not logits:
            return torch.empty(0, self.model.config.vocab_size)
        return torch.cat(logits).cpu()
