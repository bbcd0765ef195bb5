"""Pipeline stages: a step's sequences cut into micro-batches that flow stage to stage.

The driver cuts a step into at most ``pp`` micro-batches of whole sequences (contiguous in batch order, about
equal in tokens), none smaller than ``min_tokens``: each micro-batch reads all of a stage's weights again,
which a decode step of a few tokens pays in full and no overlap wins back. Stage 0 embeds micro-batch 0,
sends its hidden states on (without waiting for them to be received) and starts micro-batch 1 while stage 1
works on micro-batch 0, and so on; the last stage computes the logits of the rows that sample, micro-batch
after micro-batch, which is batch order again, and its first tensor-parallel rank samples them: only token
ids (and the logprobs asked for) go back to the driver. Sequences never attend across micro-batches, so the
cut changes no token. The cut and what each step sends are in ``engine.parallel.step_plan``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from engine.attention import KVCache
from engine.model.llama import CausalLM
from engine.parallel.distributed import ParallelConfig, RankPlacement
from engine.parallel.step_plan import StageState, StepPlan
from engine.sampler import Sampler, SamplerOutput
from engine.step_metadata import StepMetadata


class PipelineStage:
    """One rank's part of every step: its layers, its shard, its KV cache (its layers, its KV heads), the
    block tables of the running sequences and, on the rank that samples, their sampler state."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        placement: RankPlacement,
        parallel: ParallelConfig,
        device: torch.device,
        max_num_seqs: int = 64,
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
        self.state = StageState()
        self.metadata = StepMetadata(kv_cache.block_size, device, max_num_seqs)
        # The last stage's first tensor-parallel rank samples: its peers hold the same logits.
        samples = self.next_rank is None and tp_rank == 0
        self.sampler = Sampler(model.config.vocab_size) if samples else None

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> SamplerOutput | None:
        """Run every micro-batch through this stage. The sampling rank returns the step's sampled tokens
        (rows in batch order), every other rank None."""
        for table in self.state.apply(plan):
            self.metadata.release(table)
        if self.sampler is not None:
            for rid in plan.forget:
                self.sampler.forget(rid)
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        logits: list[torch.Tensor] = []
        for mb in plan.micro_batches:
            token_ids = np.asarray(mb.token_ids, dtype=np.int64)
            meta, ids, positions = self.metadata.build(self.state.step_seqs(mb), token_ids)
            assert ids is not None
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
            elif mb.sample_rows:  # on every tensor-parallel rank: the vocabulary-parallel head gathers
                rows = torch.as_tensor(mb.sample_rows, dtype=torch.long, device=self.device)
                logits.append(self.model.compute_logits(hidden[rows]))
        for work, _ in sends:
            work.wait()
        if self.sampler is None:
            return None
        if not logits:
            return SamplerOutput([], [])
        seqs = self.state.sampling_seqs(plan)
        return self.sampler.sample(torch.cat(logits), seqs, plan.eos_token_ids)
