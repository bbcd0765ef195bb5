"""Runs one scheduled step on the model: builds the flattened batch, runs it, returns next-token logits.

The only part of the engine that runs the model; the logits stay on its device, where engine.sampler draws
from them (only the sampled ids cross to the host). Everything else is plain Python bookkeeping.
"""

from __future__ import annotations

import torch

from engine.attention import KVCache, build_metadata
from engine.kv_export import layer_sender, plan_exports
from engine.model.llama import CausalLM
from engine.parallel.pipeline import MicroBatch
from engine.scheduler import ScheduledSeq


class ModelRunner:
    failure: BaseException | None = None  # one process: a failing step raises, nothing fails in between

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """Compute every scheduled token; returns float32 logits [N, vocab] on the model's device for the N
        entries that sample, in batch order."""
        step = MicroBatch.of(batch)
        meta = build_metadata(step.slices, self.kv_cache.block_size, self.device)
        input_ids = torch.as_tensor(step.token_ids, dtype=torch.long, device=self.device)
        pos = torch.as_tensor(step.positions, dtype=torch.long, device=self.device)
        plans = plan_exports(batch, self.kv_cache.block_size)
        self.kv_cache.on_layer_stored = layer_sender(plans, self.kv_cache) if plans else None
        try:
            hidden = self.model(input_ids, pos, self.kv_cache, meta)
        finally:
            self.kv_cache.on_layer_stored = None
        if not step.sample_rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        rows = torch.as_tensor(step.sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])  # float32 already

    def close(self) -> None:
        """Nothing to release (the parallel executor's ``close`` stops its workers)."""
