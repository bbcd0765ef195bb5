"""What :class:`~engine.llm_engine.LLMEngine` hands out and refuses: step outputs (with their tokens'
logprobs when asked for), K/V import tickets, rejected requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability and, when asked for, the likeliest tokens' (best first), all
    from the model's raw logits (see engine.sampler)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob)


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
    logprobs: tuple[TokenLogprob, ...] = ()  # one per entry of token_ids, when the request asked for them


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
