"""The engine's side of ``/v1/embeddings``: a prompt's last hidden state (after the final norm, before
``lm_head``), which the API side pools as vLLM's default for an embed-converted causal LM does (LAST token,
L2-normalised: ``engine.embeddings_api``).

How it runs, and why: a prompt is run through the model on the engine's own thread between two steps,
outside the scheduler, in the engine's own KV cache. It takes free blocks from the ``BlockManager`` (reusing
the prompt's cached prefix, as vLLM's embed pooling reads the prefix cache), runs its forward in chunks of
at most ``max_num_batched_tokens`` (the activations a step may need, so that it needs no memory a step
would not), and gives the blocks back before the next step: the scheduler never sees it, its blocks are
never entered into the prefix cache (so it publishes no KV events, beyond the evictions its blocks cause),
and sampling, CUDA graphs and stop strings have nothing to do with it. A prefill-only sequence through the
scheduler would batch with decodes, but would need a sequence kind that returns hidden states instead of
logits through the scheduler, the runner, step outputs and the engine-core messages; this path touches
none of them. A prompt waits (FIFO) while the cache has too few free blocks, and is tried again after each
step. A tensor- or pipeline-parallel engine (the model in worker processes) does not serve embeddings.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import SeqSlice, build_metadata
from engine.engine_types import RequestRejected
from engine.model_runner import ModelRunner
from engine.sequence import CacheNamespace, SamplingParams, Sequence

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

PREFILL_ONLY = SamplingParams(max_tokens=0)  # checks a prompt as a prefill that generates nothing


@dataclass(eq=False)
class EmbedJob:
    """One prompt waiting for its last hidden state; ``future`` gets it (float32 [hidden]) or the error."""

    request_id: str
    prompt: list[int]
    namespace: CacheNamespace
    future: concurrent.futures.Future[np.ndarray] = field(default_factory=concurrent.futures.Future)


class EmbedQueue:
    """Embedding jobs for the engine thread: added from the event loop, run by the engine thread."""

    def __init__(self) -> None:
        self._jobs: deque[EmbedJob] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    async def embed(
        self,
        engine: LLMEngine,
        request_id: str,
        prompt: list[int],
        namespace: CacheNamespace,
        wake: threading.Event,
    ) -> np.ndarray:
        """Queue ``prompt`` and wait for its last hidden state; RequestRejected for one the engine could
        never serve. Cancelling the wait drops a job not yet started."""
        check_embeddable(engine, prompt)
        job = EmbedJob(request_id, prompt, namespace)
        with self._lock:
            self._jobs.append(job)
        wake.set()
        return await asyncio.wrap_future(job.future)

    def run(self, engine: LLMEngine) -> None:
        """On the engine thread: run the jobs in order while the cache has blocks for them."""
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs[0]
            if job.future.cancelled():  # its client left before it ran
                self._pop(job)
                continue
            try:
                hidden = last_hidden_state(engine, job.request_id, job.prompt, job.namespace)
            except Exception as exc:  # fails this prompt alone (the steps will say if the model is broken)
                self._pop(job)
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(exc)
                continue
            if hidden is None:
                return  # too few free blocks now: the next step may free some
            self._pop(job)
            if job.future.set_running_or_notify_cancel():
                job.future.set_result(hidden)

    def fail_all(self, exc: BaseException) -> None:
        """The engine serves nothing more: every waiting job fails with ``exc``."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), deque()
        for job in jobs:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(exc)

    def _pop(self, job: EmbedJob) -> None:
        with self._lock:
            if self._jobs and self._jobs[0] is job:
                self._jobs.popleft()


def check_embeddable(engine: LLMEngine, prompt: list[int]) -> None:
    """Raise RequestRejected for a prompt this engine can never embed."""
    if not isinstance(engine.runner, ModelRunner):
        raise RequestRejected("embeddings are not served by a tensor- or pipeline-parallel engine")
    blocks = engine.blocks
    if blocks.blocks_for(len(prompt)) > blocks.num_blocks:  # (check_request would speak of max_tokens)
        raise RequestRejected(
            f"the input's {len(prompt)} tokens need {blocks.blocks_for(len(prompt))} KV blocks; this engine "
            f"has {blocks.num_blocks}"
        )
    engine.check_request(prompt, PREFILL_ONLY)


@torch.inference_mode()
def last_hidden_state(
    engine: LLMEngine, request_id: str, prompt: list[int], namespace: CacheNamespace
) -> np.ndarray | None:
    """The final-norm hidden state of ``prompt``'s last token, float32 [hidden]; None while the KV cache
    has too few free blocks for it. Call it on the engine thread, between steps."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    blocks = engine.blocks
    seq = Sequence(request_id, prompt, PREFILL_ONLY, engine.hash_seed(namespace.salt))
    if namespace.shared_blocks:
        seq.public_seed, seq.shared_blocks = engine.hash_seed(""), namespace.shared_blocks
    if not blocks.can_allocate(seq):
        blocks.forget(seq)
        return None
    started = time.perf_counter()
    start = blocks.allocate(seq)  # the cached prefix's K/V is reused (its last token is always computed)
    try:
        chunk = engine.config.max_num_batched_tokens
        device, size = runner.device, blocks.block_size
        hidden = torch.empty(0)
        while start < len(prompt):
            n = min(chunk, len(prompt) - start)
            meta = build_metadata([SeqSlice(seq.block_table, start, n)], size, device)
            ids = torch.tensor(prompt[start : start + n], dtype=torch.long, device=device)
            positions = torch.arange(start, start + n, dtype=torch.long, device=device)
            hidden = runner.model(ids, positions, runner.kv_cache, meta)
            start += n
        last: np.ndarray = hidden[-1].float().cpu().numpy()
    finally:
        blocks.free(seq)
        engine.counters.busy["prefill"].add(time.perf_counter() - started)  # an embedding is a prefill
    return last
