"""Runs one scheduled step on the model: builds the flattened batch, runs it, returns next-token logits.
On CUDA a decode step of up to ``max_num_seqs`` sequences replays a captured graph (``engine.cuda_graphs``).

The only part of the engine that runs the model; the logits stay on its device, where engine.sampler draws
from them (only the sampled ids cross to the host). Everything else is plain Python bookkeeping. The block
tables persist from step to step (``StepMetadata``): a step writes only the rows that changed.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch

from engine.attention import KVCache, SeqSlice, build_metadata
from engine.cuda_graphs import DecodeGraphs
from engine.kernels import ops
from engine.kv_export import layer_sender, plan_exports
from engine.model.llama import CausalLM
from engine.sampler import Sampler, SamplerOutput
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
        *,
        scratch_block: int | None = None,  # a KV block no sequence gets: CUDA graphs' padding writes there
        max_model_len: int | None = None,  # sizes the graphs' block tables
        cuda_graphs: bool = False,  # decode steps from CUDA graphs (CUDA with Triton only; needs both above)
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.metadata = StepMetadata(kv_cache.block_size, device, max_num_seqs, max_blocks_per_seq)
        self.scratch_block = scratch_block
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None
        probe = torch.empty(0, device=device)
        if cuda_graphs and device.type == "cuda" and ops.use_triton(probe) and scratch_block is not None:
            assert max_model_len is not None
            max_blocks = -(-max_model_len // kv_cache.block_size)
            self.decode_graphs = DecodeGraphs(
                model, kv_cache, scratch_block, max_num_seqs, max_blocks, device, capture=True
            )

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
        graphs = self.decode_graphs
        if graphs is not None and not plans and graphs.fits(meta):  # a graph sends no layer as it goes
            hidden = graphs.run(input_ids, pos, meta)
        else:
            self.kv_cache.on_layer_stored = layer_sender(plans, self.kv_cache) if plans else None
            try:
                hidden = self.model(input_ids, pos, self.kv_cache, meta)
            finally:
                self.kv_cache.on_layer_stored = None
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        rows = torch.as_tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])  # float32 already

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """Run one prompt of ``num_tokens`` dummy tokens, its K/V all written to the scratch block, so that
        the first real step that large finds its memory already mapped (as vLLM's dummy run at start-up).
        Call it on the thread that will run the steps: glibc gives each thread an arena of its own."""
        assert self.scratch_block is not None, "warming up writes to the scratch block"
        block = self.kv_cache.block_size
        table = [self.scratch_block] * -(-num_tokens // block)
        meta = build_metadata([SeqSlice(table, 0, num_tokens)], block, self.device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        hidden = self.model(ids, pos, self.kv_cache, meta)
        self.model.compute_logits(hidden[-1:])

    def execute(
        self, batch: list[ScheduledSeq], sampler: Sampler, eos_token_ids: Iterable[int] = ()
    ) -> SamplerOutput | None:
        """Run the step and sample the entries that sample, in batch order (None when none does)."""
        logits = self.run(batch)
        sampling = [item.seq for item in batch if item.samples]
        return sampler.sample(logits, sampling, eos_token_ids) if sampling else None

    def close(self) -> None:
        """Nothing to release (the parallel executor's ``close`` stops its workers)."""
