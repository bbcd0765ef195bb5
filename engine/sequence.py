"""One request inside the engine: its tokens, its blocks, how far its KV cache is computed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cache.hashing import block_hashes, public_blocks, shared_boundary_seed

if TYPE_CHECKING:
    from engine.kv_export import ExportSink


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one sequence picks its tokens (engine.sampler applies them, the whole batch at once)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or negative: off
    min_p: float = 0.0  # drop tokens less likely than min_p x the likeliest one; 0: off
    seed: int | None = None  # same seed, same output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # generating one ends the answer ("stop"); its text is not output
    ignore_eos: bool = False  # EOS is an ordinary token: generation runs to max_tokens
    min_tokens: int = 0  # EOS and stop_token_ids cannot be generated before this many tokens
    # OpenAI's penalties, over the generated tokens: logit -= frequency x count + presence x (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers' / vLLM's, over prompt and generated tokens: a positive logit is divided by it, a
    # negative one multiplied.
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the k likeliest tokens'

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """Whose KV a request may share: its cache salt (a tenant's), and how many leading blocks belong to an
    operator-declared public prefix that every tenant shares (hashed in the salt-less namespace)."""

    salt: str = ""
    shared_blocks: int = 0


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then every generated token
    params: SamplingParams
    hash_seed: int  # namespace of the block hashes (model + cache salt)
    public_seed: int | None = None  # namespace of the first ``shared_blocks`` blocks (a shared public prefix)
    shared_blocks: int = 0
    num_prompt_tokens: int = 0
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose K/V sit in the cache
    num_registered: int = 0  # leading full blocks entered into the prefix cache
    num_cached_prompt_tokens: int | None = None  # prefix-cache hit at first admission (what usage reports)
    queued_prefill: int = 0  # while it waits: its tokens past the cached prefix it had when queued
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    # Disaggregation. A decode-side sequence waits (holding its blocks) while its prompt's K/V arrives; a
    # prefill-side sequence computes its tokens and streams their K/V from ``export_from`` on, never sampling.
    awaiting_kv: bool = False
    import_end: int = 0  # the import covers positions num_computed .. import_end
    kv_pull: bool = False  # the import is a pull from a peer's cache: it may bring fewer, or fail harmlessly
    export: ExportSink | None = None
    export_from: int = 0
    _hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def block_hashes(self, block_size: int) -> list[int]:
        """Chain hashes of every full block of the tokens so far (extended incrementally, never rehashed).
        Equal to ``cache.hashing.namespaced_block_hashes`` of the whole sequence."""
        full = len(self.token_ids) // block_size
        shared = public_blocks(self.shared_blocks, self.hash_seed, self.public_seed)
        while len(self._hashes) < full:
            done = len(self._hashes)
            if done < shared:  # still inside the public prefix
                end, seed, parent = min(full, shared), self.public_seed, self._hashes[-1] if done else None
            else:
                end, seed = full, self.hash_seed
                parent = self._hashes[-1] if done > shared else None
                if done == shared and shared:
                    parent = shared_boundary_seed(self._hashes[-1], self.hash_seed)
            assert seed is not None
            tail = self.token_ids[done * block_size : end * block_size]
            self._hashes.extend(block_hashes(tail, block_size, seed, parent=parent))
        return self._hashes[:full]

    def block_tokens(self, index: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[index * block_size : (index + 1) * block_size])
