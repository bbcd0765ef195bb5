"""The engine: requests in, tokens out, one ``step()`` at a time (synchronous; see async_engine).

Its K/V transfer (export, import, pull) is mixed in from :mod:`engine.kv_engine`; the values it hands out
and the error it raises are in :mod:`engine.engine_types`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cache.hashing import namespace_seed
from cache.tokens import Tokenizer, load_tokenizer
from engine.attention import KVCache
from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_types import RequestRejected, StepOutput, TokenLogprob
from engine.host_memory import keep_freed_memory
from engine.kv_cache_sizing import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    activation_reserve_bytes,
    cuda_memory_info,
    kv_cache_blocks,
)
from engine.kv_engine import KvTransferMixin
from engine.metrics import EngineCounters
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.packed_linear import pack_linears
from engine.model_runner import ModelRunner
from engine.parallel.distributed import (
    ParallelConfig,
    ParallelConfigError,
    check_parallel,
    kv_bytes_per_block,
)
from engine.sampler import MAX_LOGPROBS, Sampler
from engine.scheduler import Scheduler
from engine.sequence import CacheNamespace, SamplingParams, Sequence

if TYPE_CHECKING:
    from engine.model.llama import CausalLM
    from engine.parallel.executor import ParallelExecutor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    served_model_name: str | None = None  # default: the model directory's name
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: as many as kv_memory_gib holds
    kv_memory_gib: float | None = None  # default: profiled on CUDA (below), else DEFAULT_KV_MEMORY_GIB
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION  # CUDA: the share of the device's memory
    dtype: str | None = None  # default: the checkpoint's own
    device: str | None = None  # default: cuda when available
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: max_position_embeddings, or what the KV cache holds if less
    compressed_weights: bool = False  # BF16 weights held in the palette form, each layer expanded as it runs
    tensor_parallel_size: int = 1  # with either above 1, tp x pp worker processes run the model
    pipeline_parallel_size: int = 1
    cuda_graphs: bool = True  # on CUDA, decode steps replay captured graphs (engine.cuda_graphs)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


@contextlib.contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """On CPU, torch on one thread inside (the caller's count again after). libgomp gives each thread that
    runs a parallel region a team of its own, and once it manages more threads than there are CPUs it stops
    spin-waiting between regions: a model loaded on N threads here, then stepped on another thread (the
    servers' step thread), made every decode step wait for futex wake-ups (2 cores: 4.1-4.5 ms a step
    instead of 2.4-2.8). Loaded on one thread, the step thread's team is the only one."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class LLMEngine(KvTransferMixin):
    def __init__(self, config: EngineConfig, *, detokenize: bool = True) -> None:
        """With ``detokenize=False`` (an engine core apart from its API process, ``engine.core``) outputs
        carry token ids without text and stop strings are not looked for: the API process does both."""
        self.config = config
        self.detokenize = detokenize
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            keep_freed_memory()  # activations are not page-faulted in again each step
        dtype = _DTYPES[config.dtype] if config.dtype else None
        self.tokenizer: Tokenizer = load_tokenizer(config.model_dir)
        # tp x pp > 1: the model and its KV cache live in worker processes, this process schedules.
        self.model: CausalLM | None = None
        self.model_config: ModelConfig
        self.kv_cache: KVCache | None = None
        self.runner: ModelRunner | ParallelExecutor
        if config.parallel.world_size > 1:
            if config.compressed_weights:
                raise ParallelConfigError("compressed weights need tensor and pipeline parallel sizes of 1")
            num_blocks = self._start_parallel(config, dtype)
            mc = self.model_config
        else:
            with _one_cpu_thread(self.device):
                self.model, self.model_config = load_model(config.model_dir, dtype=dtype, device=self.device)
                self.dtype = next(self.model.parameters()).dtype
                if config.compressed_weights:
                    from engine.compress.in_memory import keep_compressed

                    keep_compressed(self.model)
                elif self.device.type == "cpu":
                    pack_linears(self.model)  # oneDNN's packed GEMMs: 2-3x torch's default in fp32
                mc = self.model_config
                num_blocks = self._num_kv_blocks(mc)
                self.kv_cache = KVCache(
                    mc.num_hidden_layers,
                    num_blocks + 1,  # the last: the scratch block (CUDA graphs, warm-up), never handed out
                    config.block_size,
                    mc.num_key_value_heads,
                    mc.head_dim,
                    self.dtype,
                    self.device,
                )
            self.runner = ModelRunner(
                self.model,
                self.kv_cache,
                self.device,
                config.max_num_seqs,
                scratch_block=num_blocks,
                max_model_len=self._context_length(mc, num_blocks),
                cuda_graphs=config.cuda_graphs and not config.compressed_weights,
            )
        self.max_model_len = self._context_length(mc, num_blocks)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        eos = mc.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list | tuple) else [] if eos is None else [eos])
        self._transferred: dict[str, int] = {}
        self.idle = True  # the last step found nothing to compute
        self.counters = EngineCounters()
        self._seqs: dict[str, Sequence] = {}
        self.sampler = Sampler(mc.vocab_size)  # each sequence's generator and token counts
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._sent_tokens: dict[str, int] = {}

    def _start_parallel(self, config: EngineConfig, dtype: torch.dtype | None) -> int:
        """Check the layout, size the KV cache per rank and spawn the workers; returns the block count."""
        from engine.parallel.executor import ParallelExecutor  # spawns processes: only when asked

        self.model_config = mc = ModelConfig.from_dir(config.model_dir)
        check_parallel(mc, config.parallel)
        self.dtype = dtype or getattr(torch, mc.torch_dtype)
        num_blocks = self._num_kv_blocks(mc)
        self.runner = ParallelExecutor(
            config.model_dir,
            config.parallel,
            device=self.device,
            dtype=str(self.dtype).removeprefix("torch."),
            num_blocks=num_blocks,
            block_size=config.block_size,
            vocab_size=mc.vocab_size,
            max_num_seqs=config.max_num_seqs,
        )
        return num_blocks

    def _context_length(self, mc: ModelConfig, num_blocks: int) -> int:
        """The longest sequence this engine serves. Unset, it is what the model allows and the KV cache can
        hold (a chat without max_tokens may fill it, so it must fit); a configured one larger than the cache
        is the operator's to keep. The decode graphs are sized by it too: sized for the model's whole
        context instead, their attention would run splits for blocks no sequence can have."""
        return self.config.max_model_len or min(
            mc.max_position_embeddings, num_blocks * self.config.block_size
        )

    def _num_kv_blocks(self, mc: ModelConfig) -> int:
        """KV blocks per rank: as configured; else, on CUDA with the model in this process, what
        ``gpu_memory_utilization`` leaves of the device once the model is loaded; else as many as
        ``kv_memory_gib`` (or its default) holds on the busiest rank (engine.kv_cache_sizing)."""
        config = self.config
        element_size = torch.empty((), dtype=self.dtype).element_size()
        bytes_per_block = kv_bytes_per_block(mc, config.parallel, config.block_size, element_size)
        # Tensor/pipeline ranks load the model in their own processes: they are not profiled (yet).
        profiled = self.device.type == "cuda" and getattr(self, "model", None) is not None
        reserve = 0
        if profiled and not config.num_kv_blocks and config.kv_memory_gib is None:
            reserve = activation_reserve_bytes(
                mc,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                element_size=element_size,
            )
        return kv_cache_blocks(
            bytes_per_block=bytes_per_block,
            on_cuda=profiled,
            num_kv_blocks=config.num_kv_blocks,
            kv_memory_gib=config.kv_memory_gib,
            gpu_memory_utilization=config.gpu_memory_utilization,
            memory_info=cuda_memory_info(self.device) if profiled else None,
            reserve_bytes=reserve,
        )

    @property
    def failure(self) -> BaseException | None:
        """Why this engine can compute nothing more (a worker rank died), or None while it can."""
        return self.runner.failure

    def close(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to do in one process)."""
        self.runner.close()

    @property
    def model_name(self) -> str:
        return self.config.model_name

    def hash_seed(self, cache_salt: str = "") -> int:
        return namespace_seed(self.model_name, cache_salt)

    def _sequence(
        self, request_id: str, prompt: list[int], params: SamplingParams, namespace: CacheNamespace
    ) -> Sequence:
        seq = Sequence(request_id, prompt, params, self.hash_seed(namespace.salt))
        if namespace.shared_blocks:
            seq.public_seed, seq.shared_blocks = self.hash_seed(""), namespace.shared_blocks
        return seq

    # -- requests ---------------------------------------------------------------------------------------

    def check_request(self, prompt: Seq[int], params: SamplingParams) -> None:
        """Raise RequestRejected for a request this engine could never serve."""
        if not prompt:
            raise RequestRejected("the prompt is empty")
        vocab = self.model_config.vocab_size
        if max(prompt) >= vocab:
            raise RequestRejected(f"token id {max(prompt)} is outside the model's vocabulary of {vocab}")
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise RequestRejected(f"{name} holds a token id outside the model's vocabulary of {vocab}")
        if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
            raise RequestRejected(f"logprobs must lie in [0, {MAX_LOGPROBS}]")
        needed = len(prompt) + params.max_tokens
        if needed > self.max_model_len:
            raise RequestRejected(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        if self.blocks.blocks_for(needed) > self.blocks.num_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {self.blocks.blocks_for(needed)} KV blocks; this engine has "
                f"{self.blocks.num_blocks}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        namespace: CacheNamespace | None = None,
        *,
        import_kv: bool = False,
        pull_tokens: int | None = None,
    ) -> None:
        """Queue a request. With ``import_kv`` its prompt's K/V (all but the last token) will come from a
        prefill engine: see ``take_import_tickets`` and ``finish_import``. With ``pull_tokens`` the K/V of
        up to that many leading prompt tokens (all but the last at most) beyond its own cached prefix will
        be pulled from a peer's prefix cache, which may hold fewer: see ``finish_pull``."""
        if request_id in self._seqs:
            raise RequestRejected(f"request id {request_id!r} is already running")
        if import_kv and pull_tokens is not None:
            raise RequestRejected("a request imports its K/V from a prefill engine or pulls it, not both")
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, params)
        seq = self._sequence(request_id, prompt, params, namespace or CacheNamespace())
        seq.awaiting_kv = import_kv or pull_tokens is not None
        seq.kv_pull = pull_tokens is not None
        # The last prompt token is always computed here: its step yields the first token's logits.
        seq.import_end = len(prompt) - 1 if pull_tokens is None else min(pull_tokens, len(prompt) - 1)
        self._seqs[request_id] = seq
        if self.detokenize:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.min_tokens)
        self._sent_tokens[request_id] = 0
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self._forget(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def warm_up(self) -> None:
        """On CPU, one dummy step of the token budget (``ModelRunner.warm_up``), on the calling thread: the
        first long prompt then costs what the next ones do (a 2000-token prompt of a 2-layer, hidden-256
        model: 195 ms of CPU the first time on a new thread, 158 ms after). Nothing elsewhere."""
        if self.device.type == "cpu" and isinstance(self.runner, ModelRunner):
            self.runner.warm_up(min(self.config.max_num_batched_tokens, self.max_model_len))

    # -- the step ---------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        self._send_cached_exports()
        self.idle = not batch
        if not batch:
            return []
        started = time.perf_counter()
        prefill_tokens = sum(
            item.num_new for item in batch if item.seq.num_computed < item.seq.num_prompt_tokens
        )
        sampling = [item.seq for item in batch if item.samples]
        sampled = self.runner.execute(batch, self.sampler, self.eos_token_ids)
        # The step's time, split between the stages by the tokens each contributed to it.
        elapsed, total_tokens = time.perf_counter() - started, sum(item.num_new for item in batch)
        prefill_share = prefill_tokens / total_tokens if total_tokens else 0.0
        self.counters.busy["prefill"].add(elapsed * prefill_share)
        self.counters.busy["decode"].add(elapsed * (1.0 - prefill_share))
        for item in batch:
            seq = item.seq
            seq.num_computed += item.num_new
            self.blocks.register_full_blocks(seq)
            if seq.export is not None and seq.export.stalled:  # its receiver stopped reading: give it up
                self.abort(seq.request_id)
            elif seq.export is not None and seq.num_computed == seq.num_tokens:
                self._finish_export(seq)
        outputs = []
        if sampled is not None:
            for seq, token, logprob in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True):
                seq.token_ids.append(token)
                outputs.append(self._after_token(seq, token, logprob))
        return outputs

    def _after_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> StepOutput:
        detok = self._detok.get(seq.request_id)  # None without detokenize
        reason = None
        params = seq.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = "stop"
        else:
            if detok is not None:
                detok.add(token)
            if detok is not None and detok.stopped:
                reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        sent = self._sent_tokens[seq.request_id]
        output = StepOutput(
            request_id=seq.request_id,
            text=detok.take(final=reason is not None) if detok is not None else "",
            token_ids=tuple(seq.output_token_ids[sent:]),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_prompt_tokens or 0,
            completion_tokens=seq.num_output_tokens,
            kv_transferred_tokens=self._transferred.get(seq.request_id, 0),
            logprobs=() if logprob is None else (logprob,),  # each step outputs the one token it drew
        )
        self._sent_tokens[seq.request_id] = seq.num_output_tokens
        if reason is not None:
            self.counters.finished(output.prompt_tokens, output.cached_tokens, output.completion_tokens)
            self._forget(seq.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        for table in (self._seqs, self._detok, self._sent_tokens, self._transferred):
            table.pop(request_id, None)
        self.sampler.forget(request_id)

    # -- offline use --------------------------------------------------------------------------------------

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); the generated token ids of each."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"offline-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, p)
        results: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_work():
            for out in self.step():
                results[out.request_id].extend(out.token_ids)
        return [results[i] for i in ids]

    # -- load -------------------------------------------------------------------------------------------

    def load(self) -> dict[str, int]:
        s = self.scheduler
        return {
            "running": len(s.running),
            "waiting": len(s.waiting),
            "waiting_tokens": s.waiting_tokens,
            "max_running": s.max_num_seqs,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_cached": self.blocks.num_cached,
            "preemptions": s.preemptions,
        }
