"""The engine: requests in, tokens out, one ``step()`` at a time (synchronous; see async_engine)."""

from __future__ import annotations

import time
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
from engine.kv_export import send_cached, send_positions
from engine.metrics import EngineCounters
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model_runner import ModelRunner
from engine.parallel.distributed import (
    ParallelConfig,
    ParallelConfigError,
    check_parallel,
    kv_bytes_per_block,
)
from engine.sampler import make_generator, sample
from engine.scheduler import Scheduler
from engine.sequence import CacheNamespace, SamplingParams, SeqStatus, Sequence

if TYPE_CHECKING:
    from engine.kv_export import ExportSink
    from engine.model.llama import CausalLM
    from engine.parallel.executor import ParallelExecutor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    served_model_name: str | None = None  # default: the model directory's name
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: as many as kv_memory_gib holds
    kv_memory_gib: float = 0.5
    dtype: str | None = None  # default: the checkpoint's own
    device: str | None = None  # default: cuda when available
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    compressed_weights: bool = False  # BF16 weights held in the palette form, each layer expanded as it runs
    tensor_parallel_size: int = 1  # with either above 1, tp x pp worker processes run the model
    pipeline_parallel_size: int = 1

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).resolve().name


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: str
    text: str  # new text since the last output
    token_ids: tuple[int, ...]  # new tokens since the last output
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    kv_transferred_tokens: int = 0  # prompt positions whose K/V came from a prefill engine or a peer's cache


@dataclass(frozen=True, slots=True)
class ImportTicket:
    """A decode-side sequence that now holds blocks and waits for positions ``start .. end`` of its K/V.
    With ``pull`` they come from a peer's prefix cache, which may hold fewer (``LLMEngine.finish_pull``)."""

    request_id: str
    prompt_token_ids: list[int]
    start: int
    end: int
    block_table: list[int]
    pull: bool = False


class RequestRejected(ValueError):
    """A request the engine can never serve (too long for its context or its KV cache)."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
            self.model, self.model_config = load_model(config.model_dir, dtype=dtype, device=self.device)
            self.dtype = next(self.model.parameters()).dtype
            if config.compressed_weights:
                from engine.compress.in_memory import keep_compressed

                keep_compressed(self.model)
            mc = self.model_config
            num_blocks = self._num_kv_blocks(mc)
            self.kv_cache = KVCache(
                mc.num_hidden_layers,
                num_blocks,
                config.block_size,
                mc.num_key_value_heads,
                mc.head_dim,
                self.dtype,
                self.device,
            )
            self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
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
        self._generators: dict[str, torch.Generator] = {}
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
        )
        return num_blocks

    def _num_kv_blocks(self, mc: ModelConfig) -> int:
        """KV blocks per rank: as configured, or as many as ``kv_memory_gib`` holds on the busiest rank."""
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        element_size = torch.empty((), dtype=self.dtype).element_size()
        bytes_per_block = kv_bytes_per_block(mc, config.parallel, config.block_size, element_size)
        return max(1, int(config.kv_memory_gib * 2**30) // bytes_per_block)

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
        self._generators[request_id] = make_generator(params.seed)
        self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop)
        self._sent_tokens[request_id] = 0
        self.scheduler.add(seq)

    def add_export(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        namespace: CacheNamespace,
        from_position: int,
        sink: ExportSink,
    ) -> None:
        """Prefill ``prompt_token_ids`` without sampling; stream their K/V from ``from_position`` on."""
        if request_id in self._seqs:
            raise RequestRejected(f"request id {request_id!r} is already running")
        if self.kv_cache is None:
            raise RequestRejected("KV export is not supported with tensor or pipeline parallelism")
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, SamplingParams(max_tokens=0))
        if not 0 <= from_position < len(prompt):
            raise RequestRejected(
                f"from_position {from_position} is outside the prompt of {len(prompt)} tokens"
            )
        seq = self._sequence(request_id, prompt, SamplingParams(max_tokens=0), namespace)
        seq.export, seq.export_from = sink, from_position
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def take_import_tickets(self) -> list[ImportTicket]:
        """Sequences admitted since the last call that wait for their K/V (the rest of their prompt). One
        whose own prefix cache already covers what it would import gets no ticket: it computes the rest."""
        tickets = []
        for seq in self.scheduler.admitted_importers:
            if seq.status is not SeqStatus.RUNNING or not seq.awaiting_kv:
                continue
            if seq.num_computed >= seq.import_end:
                self._imported(seq, seq.num_computed, seq.num_computed)  # nothing to fetch
                continue
            tickets.append(
                ImportTicket(seq.request_id, list(seq.token_ids), seq.num_computed, seq.import_end,
                             list(seq.block_table), pull=seq.kv_pull)
            )  # fmt: skip
        self.scheduler.admitted_importers.clear()
        return tickets

    def finish_import(self, request_id: str, prefill_cached_tokens: int) -> None:
        """The K/V of every prompt position but the last has arrived: the sequence computes its last prompt
        token itself (so sampling starts from the very generator state a colocated run would have)."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.awaiting_kv or seq.kv_pull:
            return
        # Tokens nobody computed for this request: those the prefill engine found in its own cache.
        self._imported(seq, seq.import_end, prefill_cached_tokens)

    def finish_pull(self, request_id: str, pulled_to: int | None) -> None:
        """A pull from a peer's prefix cache ended. Positions up to ``pulled_to`` hold the peer's K/V (fewer
        than asked when the peer had evicted some); ``None``: the pull failed, and the sequence computes
        everything past its own cached prefix, overwriting whatever the pull had written. Either way the
        request goes on: a pull only ever saves work."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.awaiting_kv or not seq.kv_pull:
            return
        start = seq.num_computed
        end = start if pulled_to is None else max(start, min(pulled_to, seq.import_end))
        outcome = "failed" if pulled_to is None else "ok" if end == seq.import_end else "partial"
        self.counters.pulled(outcome, end - start)
        # Nobody computed the pulled positions for this request: they count as cached, like its own hits.
        self._imported(seq, end, end)

    def _imported(self, seq: Sequence, computed_to: int, cached_tokens: int) -> None:
        """Positions up to ``computed_to`` now hold K/V: the sequence computes the rest of its prompt."""
        self._transferred[seq.request_id] = computed_to - seq.num_computed
        seq.num_computed = computed_to
        seq.awaiting_kv = False
        seq.num_cached_prompt_tokens = min(cached_tokens, seq.num_prompt_tokens)
        self.blocks.register_full_blocks(seq)

    def export_cached(
        self, prompt_token_ids: Seq[int], namespace: CacheNamespace, from_position: int, sink: ExportSink
    ) -> int:
        """Serve a peer's pull: the K/V of positions ``from_position .. k`` of the prompt, where ``k`` ends
        the longest run of its full blocks in the prefix cache, then the done frame (``tokens`` = ``k``, or
        ``from_position`` when the cache holds no more). Computes nothing and queues nothing, so it never
        waits behind requests; it runs between two steps and copies the K/V out at once, so no later step
        can evict a block before it is sent. The sent blocks nobody uses are then demoted to be evicted
        first: the peer holds them now, so the pull migrates them rather than duplicating them. Returns the
        positions sent."""
        if self.kv_cache is None:
            raise RequestRejected("KV pull is not supported with tensor or pipeline parallelism")
        prompt = [int(t) for t in prompt_token_ids]
        if not 0 <= from_position < len(prompt):
            raise RequestRejected(
                f"from_position {from_position} is outside the prompt of {len(prompt)} tokens"
            )
        probe = self._sequence("kv-pull", prompt, SamplingParams(max_tokens=0), namespace)
        probe.export = sink  # an exporting sequence matches every full block (it has nothing to sample)
        run = self.blocks.match_prefix(probe)
        block_size = self.config.block_size
        end = max(len(run) * block_size, from_position)
        if end > from_position:
            send_positions(sink.send, self.kv_cache, run, from_position, end)
        sink.close({"t": "done", "tokens": end, "cached_tokens": end})
        self.blocks.demote(run[from_position // block_size :])
        self.counters.pull_served(end - from_position)
        return end - from_position

    def abort(self, request_id: str) -> None:
        seq = self._seqs.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self._forget(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

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
        logits = self.runner.run(batch)
        sampling = [item.seq for item in batch if item.samples]
        tokens = sample(
            logits, [s.params for s in sampling], [self._generators[s.request_id] for s in sampling]
        ) if sampling else []  # fmt: skip
        # The step's time, split between the stages by the tokens each contributed to it.
        elapsed, total_tokens = time.perf_counter() - started, sum(item.num_new for item in batch)
        prefill_share = prefill_tokens / total_tokens if total_tokens else 0.0
        self.counters.busy["prefill"].add(elapsed * prefill_share)
        self.counters.busy["decode"].add(elapsed * (1.0 - prefill_share))
        for item in batch:
            seq = item.seq
            seq.num_computed += item.num_new
            self.blocks.register_full_blocks(seq)
            if seq.export is not None and seq.num_computed == seq.num_tokens:
                self._finish_export(seq)
        outputs = []
        for seq, token in zip(sampling, tokens, strict=True):
            seq.token_ids.append(token)
            outputs.append(self._after_token(seq, token))
        return outputs

    def _send_cached_exports(self) -> None:
        """Exports whose every position was already cached: send them from the cache, no model step."""
        for seq in self.scheduler.cached_exports:
            assert seq.export is not None and self.kv_cache is not None
            send_cached(seq, self.kv_cache)
            self._finish_export(seq)
        self.scheduler.cached_exports.clear()

    def _finish_export(self, seq: Sequence) -> None:
        assert seq.export is not None
        cached = seq.num_cached_prompt_tokens or 0
        self.scheduler.finish(seq, "prefilled")
        seq.export.close({"t": "done", "tokens": seq.num_tokens, "cached_tokens": cached})
        self._forget(seq.request_id)

    def _after_token(self, seq: Sequence, token: int) -> StepOutput:
        detok = self._detok[seq.request_id]
        reason = None
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        else:
            detok.add(token)
            if detok.stopped:
                reason = "stop"
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        sent = self._sent_tokens[seq.request_id]
        output = StepOutput(
            request_id=seq.request_id,
            text=detok.take(final=reason is not None),
            token_ids=tuple(seq.output_token_ids[sent:]),
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_prompt_tokens or 0,
            completion_tokens=seq.num_output_tokens,
            kv_transferred_tokens=self._transferred.get(seq.request_id, 0),
        )
        self._sent_tokens[seq.request_id] = seq.num_output_tokens
        if reason is not None:
            self.counters.finished(output.prompt_tokens, output.cached_tokens, output.completion_tokens)
            self._forget(seq.request_id)
        return output

    def _forget(self, request_id: str) -> None:
        for table in (self._seqs, self._generators, self._detok, self._sent_tokens, self._transferred):
            table.pop(request_id, None)

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
