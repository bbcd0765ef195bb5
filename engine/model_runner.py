"""Runs one scheduled step on the model: builds the flattened batch, runs it, returns next-token logits.

The only part of the engine that runs the model; the logits stay on its device, where engine.sampler draws
from them (only the sampled ids cross to the host). Everything else is plain Python bookkeeping. The block
tables persist from step to step (``StepMetadata``): a step writes only the rows that changed.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from engine.attention import KVCache
from engine.kv_export import layer_sender, plan_exports
from engine.model.llama import CausalLM
from engine.scheduler import ScheduledSeq
from engine.step_metadata import StepMetadata


class ModelRunner:
    failure: BaseException | None = None  # one process: a failing step raises, nothing fails in between

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        device: torch.device,
        max_num_seqs: int = 64,
        max_blocks_per_seq: int = 16,  # both grow when a step needs more
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.metadata = StepMetadata(kv_cache.block_size, device, max_num_seqs, max_blocks_per_seq)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute every scheduled token; returns float32 logits [N, vocab] on the model's device for the N
        entries that sample, in batch order."""
        seqs = [(item.seq, item.seq.block_table, item.seq.num_computed, item.num_new) for item in batch]
        token_ids = chain.from_iterable(s.token_ids[c : c + n] for s, _, c, n in seqs)
        ids = np.fromiter(token_ids, dtype=np.int64, count=sum(n for *_, n in seqs))
        meta, input_ids, pos = self.metadata.build(seqs, ids)
        assert input_ids is not None
        ends = np.cumsum([n for *_, n in seqs]) - 1
        sample_rows = [int(ends[i]) for i, item in enumerate(batch) if item.samples]
        plans = plan_exports(batch, self.kv_cache.block_size)
        self.kv_cache.on_layer_stored = layer_sender(plans, self.kv_cache) if plans else None
        try:
            hidden = self.model(input_ids, pos, self.kv_cache, meta)
        finally:
            self.kv_cache.on_layer_stored = None
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        rows = torch.as_tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])  # float32 already

    def close(self) -> None:
        """Nothing to release (the parallel executor's ``close`` stops its workers)."""
