"""The sampling fields of an OpenAI request (OpenAI's own and vLLM's extensions), read into
:class:`~engine.sequence.SamplingParams`, and the fields that would change the answer in ways the engine
cannot: refused with a 400 naming them, never ignored.

What an engine answers beyond one plain-text choice (``n`` > 1, logprobs) it declares in
:class:`Capabilities`; the simulator declares none, the torch engine all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.openai_errors import OpenAIError
from engine.openai_params import bool_param, int_param, logit_bias_param, number_param, token_id_list_param
from engine.sequence import SamplingParams

MAX_N = 128  # as the gateway's schema
MAX_CHAT_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an engine can answer besides one plain-text choice; a request for more gets a 400."""

    max_n: int = 1
    logprobs: bool = False


PLAIN = Capabilities()
FULL = Capabilities(max_n=MAX_N, logprobs=True)


def _set(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


# Fields that would change the answer and that no kvgate engine honours, with when a value asks for it.
_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (_truthy, "echo is not supported"),
    "suffix": (lambda v: v not in (None, ""), "suffix is not supported"),
    "use_beam_search": (_truthy, "beam search is not supported"),
    "length_penalty": (lambda v: v not in (None, 1, 1.0), "length_penalty needs beam search (not supported)"),
    "early_stopping": (_truthy, "early_stopping needs beam search (not supported)"),
    "prompt_logprobs": (_set, "prompt_logprobs are not supported"),
    "include_stop_str_in_output": (_truthy, "include_stop_str_in_output is not supported"),
    "skip_special_tokens": (lambda v: v is False, "special tokens are always left out of the text"),
    "return_tokens_as_token_ids": (_truthy, "return_tokens_as_token_ids is not supported"),
    "allowed_token_ids": (_set, "allowed_token_ids is not supported"),
    "bad_words": (_truthy, "bad_words is not supported"),
    "logits_processors": (_truthy, "logits_processors are not supported"),
    "truncate_prompt_tokens": (_set, "truncate_prompt_tokens is not supported"),
    "guided_json": (_set, "guided decoding is not supported"),
    "guided_regex": (_set, "guided decoding is not supported"),
    "guided_choice": (_set, "guided decoding is not supported"),
    "guided_grammar": (_set, "guided decoding is not supported"),
    "structured_outputs": (_set, "structured outputs are not supported"),
    "response_format": (
        lambda v: v is not None and not (isinstance(v, dict) and v.get("type") == "text"),
        'only response_format {"type": "text"} is supported',
    ),
    "prediction": (_set, "predicted outputs are not supported"),
    "audio": (_set, "audio output is not supported"),
    "modalities": (lambda v: v not in (None, ["text"]), "only text output is supported"),
}


def reject_unsupported(data: dict[str, Any], kind: Literal["chat", "completion"], caps: Capabilities) -> None:
    """Refuse what would change the answer and cannot be honoured (``n`` and logprobs per ``caps``)."""
    for name, (asks, message) in _UNSUPPORTED.items():
        if asks(data.get(name)):
            raise OpenAIError(message, param=name)
    best_of = data.get("best_of")
    if best_of is not None and best_of != 1:
        raise OpenAIError("only best_of=1 is supported", param="best_of")
    if caps.max_n == 1:
        n = data.get("n")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n != 1):
            raise OpenAIError("only n=1 is supported", param="n")
    if not caps.logprobs:
        # Silently returning no logprobs would be a wrong answer; refusing is honest.
        if data.get("logprobs") not in (None, False):
            raise OpenAIError("logprobs are not supported", param="logprobs")
        if kind == "chat" and data.get("top_logprobs") is not None:
            raise OpenAIError("logprobs are not supported", param="top_logprobs")


def parse_sampling(
    data: dict[str, Any],
    kind: Literal["chat", "completion"],
    caps: Capabilities,
    *,
    max_tokens: int,
    stop: tuple[str, ...],
    vocab_size: int | None,
) -> tuple[SamplingParams, int]:
    """The request's SamplingParams and its ``n``; call :func:`reject_unsupported` first."""
    n = _optional_int(data, "n", 1, lo=1)
    if n > caps.max_n:
        raise OpenAIError(f"n must lie in [1, {caps.max_n}]", param="n")
    seed = data.get("seed")
    top_k = _optional_int(data, "top_k", 0, lo=-1)
    min_tokens = _optional_int(data, "min_tokens", 0, lo=0)
    if min_tokens > max_tokens:
        raise OpenAIError(f"min_tokens must be at most max_tokens ({max_tokens})", param="min_tokens")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number_param(data.get("temperature"), "temperature", lo=0.0, hi=2.0, default=1.0),
        top_p=number_param(data.get("top_p"), "top_p", lo=0.0, hi=1.0, default=1.0, lo_open=True),
        top_k=max(top_k, 0),
        min_p=number_param(data.get("min_p"), "min_p", lo=0.0, hi=1.0, default=0.0),
        seed=None if seed is None else int_param(seed, "seed"),
        stop=stop,
        stop_token_ids=token_id_list_param(data.get("stop_token_ids"), "stop_token_ids", vocab_size),
        ignore_eos=bool_param(data.get("ignore_eos"), "ignore_eos", default=False),
        min_tokens=min_tokens,
        presence_penalty=_penalty(data, "presence_penalty"),
        frequency_penalty=_penalty(data, "frequency_penalty"),
        repetition_penalty=number_param(
            data.get("repetition_penalty"),
            "repetition_penalty",
            lo=0.0,
            hi=MAX_REPETITION_PENALTY,
            default=1.0,
            lo_open=True,
        ),
        logit_bias=logit_bias_param(data.get("logit_bias"), vocab_size),
        logprobs=_logprobs(data, kind) if caps.logprobs else None,
    )
    return params, n


def _optional_int(data: dict[str, Any], param: str, default: int, *, lo: int) -> int:
    value = data.get(param)
    return default if value is None else int_param(value, param, lo=lo)


def _penalty(data: dict[str, Any], param: str) -> float:
    return number_param(data.get(param), param, lo=-2.0, hi=2.0, default=0.0)


def _logprobs(data: dict[str, Any], kind: Literal["chat", "completion"]) -> int | None:
    """How many top logprobs per token (0: the chosen token's only), or None for no logprobs at all.
    Chat: ``logprobs: true`` and ``top_logprobs`` in [0, 20]; completions: ``logprobs`` in [0, 5]."""
    if kind == "completion":
        value = data.get("logprobs")
        if value is None or value is False:
            return None
        k = int_param(value, "logprobs", lo=0)
        if k > MAX_COMPLETION_LOGPROBS:
            raise OpenAIError(f"logprobs must lie in [0, {MAX_COMPLETION_LOGPROBS}]", param="logprobs")
        return k
    wanted = bool_param(data.get("logprobs"), "logprobs", default=False)
    top = data.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    k = int_param(top, "top_logprobs", lo=0)
    if k > MAX_CHAT_LOGPROBS:
        raise OpenAIError(f"top_logprobs must lie in [0, {MAX_CHAT_LOGPROBS}]", param="top_logprobs")
    if not wanted:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    return k
