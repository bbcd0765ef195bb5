"""The OpenAI wire protocol shared by every kvgate engine (the torch engine and the simulator): requests.

Parsing turns a ``/v1/completions`` or ``/v1/chat/completions`` body into a :class:`GenerationRequest`;
every client mistake becomes an :class:`OpenAIError` (an OpenAI-shaped 4xx), never a 500. The answers'
bodies, SSE chunks and usage object are built in :mod:`engine.openai_format`; the error in
:mod:`engine.openai_errors`; single fields are read by :mod:`engine.openai_params`, the sampling ones (and
what is refused) by :mod:`engine.openai_sampling`. Engines own only the generation in between.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import orjson

from cache.chat_dialect import VLLM, ChatContentError
from cache.chat_template import render_messages
from cache.openai_fields import tools_requested
from cache.tokens import Tokenizer
from engine.openai_errors import OpenAIError
from engine.openai_params import (
    PACKED_IDS_FIELD,
    bool_param,
    int_param,
    stop_param,
    token_ids_param,
    unpack_token_ids,
)
from engine.openai_sampling import PLAIN, Capabilities, parse_sampling, reject_unsupported
from engine.sequence import SamplingParams

RequestKind = Literal["chat", "completion"]
FinishReason = Literal["stop", "length"]

# A completion without max_tokens stops at 16 tokens (OpenAI's legacy completions default, and vLLM's); a
# chat without max_tokens / max_completion_tokens may fill what the context leaves (OpenAI's chat and vLLM's),
# which costs nothing up front: the KV cache grows a block at a time as the answer does. With no known
# context length a chat falls back to the completion default.
DEFAULT_MAX_TOKENS = 16
DEFAULT_PARAMS = SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)

SSE_CONTENT_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class KvPull:
    """``kv_transfer_params`` of a KV pull: the peer engine at ``url`` holds (the gateway believes) the K/V
    of the prompt's first ``tokens`` tokens in its prefix cache; ``engine`` is its id, for logs only."""

    url: str
    tokens: int
    engine: str | None = None


@dataclass(slots=True)
class GenerationRequest:
    """One validated generation request, independent of which endpoint it came through."""

    kind: RequestKind
    request_id: str  # the x-request-id: correlates gateway and engine logs
    response_id: str  # the OpenAI ``id``: cmpl-<hex> / chatcmpl-<hex>
    model: str
    prompt_token_ids: np.ndarray  # uint32
    params: SamplingParams = DEFAULT_PARAMS  # of choice 0
    n: int = 1  # choices
    stream: bool = False
    include_usage: bool = False
    cache_salt: str = ""
    prefill_url: str | None = None  # disaggregated: pull the prompt's K/V from this prefill engine
    kv_pull: KvPull | None = None  # pull the K/V of a cached prefix from a peer engine
    cache_shared_blocks: int = 0  # leading blocks of an operator-declared public prefix (shared by tenants)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def stop(self) -> tuple[str, ...]:
        return self.params.stop

    @property
    def seed(self) -> int | None:
        return self.params.seed

    @property
    def temperature(self) -> float:
        return self.params.temperature

    @property
    def top_p(self) -> float:
        return self.params.top_p

    @property
    def top_k(self) -> int:
        return self.params.top_k  # 0: disabled

    @property
    def logprobs(self) -> int | None:
        return self.params.logprobs

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: a seeded request's choices draw with seed, seed + 1, ... (as vLLM),
        so that they differ from each other and each is reproducible."""
        if index == 0 or self.params.seed is None:
            return self.params
        return replace(self.params, seed=self.params.seed + index)


# Ids are random (128 bits), not a per-process prefix and a counter as they were: the ids an engine shared
# by tenants gives one of them told it how many requests the others sent in between.


def new_request_id() -> str:
    """32 hex digits, for requests that arrive without an x-request-id."""
    return os.urandom(16).hex()


def new_id(prefix: str) -> str:
    """``<prefix><32 hex digits>``: the id of a response (``cmpl-``, ``chatcmpl-``, ``resp_``) or an item
    (``msg_``)."""
    return prefix + os.urandom(16).hex()


def new_response_id(kind: RequestKind) -> str:
    return new_id("chatcmpl-" if kind == "chat" else "cmpl-")


# --------------------------------------------------------------------------------------------- parsing


def parse_request(
    body: bytes | dict[str, Any],
    kind: RequestKind,
    *,
    served_model: str,
    tokenizer: Tokenizer,
    request_id: str | None = None,
    max_model_len: int | None = None,
    capabilities: Capabilities = PLAIN,
    vocab_size: int | None = None,
    chat_fills_context: bool = True,
) -> GenerationRequest:
    """Validate a request body; raises :class:`OpenAIError` for anything a client got wrong, or asked for
    and the engine cannot do: ``capabilities`` says whether that includes n > 1 and logprobs. With
    ``vocab_size`` token ids in the prompt, logit_bias and stop_token_ids are checked against it.
    A chat without max_tokens may write what ``max_model_len`` leaves, as OpenAI's and vLLM's do, unless
    ``chat_fills_context`` is False; a completion, or a chat then, writes 16 tokens.

    ``prompt_token_ids`` (a kvgate extension the gateway sends), or the same ids packed in
    ``prompt_token_ids_hex``, wins over ``prompt`` / ``messages``: the gateway already tokenized the prompt
    to hash it, and re-tokenizing could only make the hashes disagree. ``body`` may be read as JSON already
    (the Responses API hands over the chat body it makes of its own).
    """
    data = body if isinstance(body, dict) else load_body(body)
    check_model(data, served_model)
    _reject_unsupported(data, kind, capabilities)
    if data.get(PACKED_IDS_FIELD) is not None:
        # The gateway's packing of the client's own prompt: an error about its ids names the client's field.
        prompt_param = "messages" if kind == "chat" else "prompt"
        ids = unpack_token_ids(data[PACKED_IDS_FIELD])
    elif data.get("prompt_token_ids") is not None:
        prompt_param = "prompt_token_ids"
        ids = token_ids_param(data["prompt_token_ids"], prompt_param)
    elif kind == "chat":
        prompt_param = "messages"
        ids = tokenizer.encode(_render_messages(data, tokenizer))
        if data.get("add_special_tokens") is True:  # (as vLLM: false by default for chats)
            ids = tokenizer.with_special_tokens(ids)
    else:
        prompt_param = "prompt"
        ids = _completion_prompt(data.get("prompt"), tokenizer)
        # A text prompt gets the special tokens the tokenizer adds (Llama's BOS), as in vLLM, where
        # add_special_tokens is true by default for completions; ids are taken as they are.
        if data.get("add_special_tokens") is not False and _is_text_prompt(data.get("prompt")):
            ids = tokenizer.with_special_tokens(ids)
    if ids.shape[0] == 0:
        raise OpenAIError("the prompt must not be empty", param=prompt_param)
    if vocab_size is not None and (largest := int(ids.max())) >= vocab_size:
        # (The engine refuses it too, but as a RequestRejected, which says neither field nor cause.)
        message = f"{prompt_param} holds token id {largest}, outside the model's vocabulary of {vocab_size}"
        raise OpenAIError(message, param=prompt_param)

    max_tokens_param = "max_tokens"
    max_tokens_raw = data.get("max_tokens")
    if kind == "chat" and data.get("max_completion_tokens") is not None:
        max_tokens_param, max_tokens_raw = "max_completion_tokens", data["max_completion_tokens"]
    prompt_tokens = int(ids.shape[0])
    if max_tokens_raw is not None:
        max_tokens = int_param(max_tokens_raw, max_tokens_param, lo=1)
    elif kind == "chat" and chat_fills_context and max_model_len is not None:
        max_tokens = max(1, max_model_len - prompt_tokens)
    else:
        max_tokens = DEFAULT_MAX_TOKENS
    if max_model_len is not None and prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the length of the prompt or the completion.",
            # A prompt that fills the context alone is the prompt's fault: no max_tokens would help.
            param=prompt_param if prompt_tokens >= max_model_len else max_tokens_param,
            code="context_length_exceeded",
        )

    stream = bool_param(data.get("stream"), "stream", default=False)
    include_usage = False
    stream_options = data.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise OpenAIError("stream_options must be an object", param="stream_options")
        include_usage = bool_param(
            stream_options.get("include_usage"), "stream_options.include_usage", default=False
        )
        if stream_options.get("continuous_usage_stats"):
            raise OpenAIError(
                "continuous_usage_stats is not supported", param="stream_options.continuous_usage_stats"
            )

    params, n = parse_sampling(
        data,
        kind,
        capabilities,
        max_tokens=max_tokens,
        stop=stop_param(data.get("stop")),
        vocab_size=vocab_size,
    )
    cache_salt = data.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise OpenAIError("cache_salt must be a string", param="cache_salt")
    prefill_url, kv_pull = _kv_transfer_params(data.get("kv_transfer_params"))
    shared_raw = data.get("cache_shared_blocks")
    shared_blocks = 0 if shared_raw is None else int_param(shared_raw, "cache_shared_blocks", lo=0)

    return GenerationRequest(
        kind=kind,
        request_id=request_id or new_request_id(),
        response_id=new_response_id(kind),
        model=served_model,
        prompt_token_ids=ids,
        params=params,
        n=n,
        stream=stream,
        include_usage=stream and include_usage,
        cache_salt=cache_salt or "",
        prefill_url=prefill_url,
        kv_pull=kv_pull,
        cache_shared_blocks=shared_blocks,
    )


def load_body(body: bytes) -> dict[str, Any]:
    """A request body as the JSON object it must be."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise OpenAIError("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise OpenAIError("the request body must be a JSON object")
    return data


def check_model(data: dict[str, Any], served_model: str) -> None:
    """A request's ``model``: missing means "whatever this engine serves" (engines serve exactly one)."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise OpenAIError("model must be a string", param="model")
    if model is not None and model != served_model:
        raise OpenAIError(
            f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found"
        )


def _kv_transfer_params(params: Any) -> tuple[str | None, KvPull | None]:
    """``kv_transfer_params``: either ``prefill_url``, the engine to pull this prompt's K/V from
    (disaggregation), or ``pull_url`` + ``pull_tokens`` (+ ``pull_engine``), a peer engine holding the
    K/V of a prefix of it in its cache (a KV pull)."""
    if params is None:
        return None, None
    if not isinstance(params, dict):
        raise OpenAIError("kv_transfer_params must be an object", param="kv_transfer_params")
    prefill_url = _url(params, "prefill_url")
    pull_url = _url(params, "pull_url")
    if pull_url is None:
        return prefill_url, None
    if prefill_url is not None:
        raise OpenAIError(
            "kv_transfer_params takes prefill_url or pull_url, not both", param="kv_transfer_params"
        )
    tokens, engine = params.get("pull_tokens"), params.get("pull_engine")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise OpenAIError(
            "kv_transfer_params.pull_tokens must be a non-negative integer", param="kv_transfer_params"
        )
    if engine is not None and not isinstance(engine, str):
        raise OpenAIError("kv_transfer_params.pull_engine must be a string", param="kv_transfer_params")
    return None, KvPull(pull_url, tokens, engine)


def _url(params: dict[str, Any], key: str) -> str | None:
    url = params.get(key)
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise OpenAIError(f"kv_transfer_params.{key} must be an http(s) URL", param="kv_transfer_params")
    return url.rstrip("/")


def _reject_unsupported(data: dict[str, Any], kind: RequestKind, capabilities: Capabilities) -> None:
    reject_unsupported(data, kind, capabilities)
    # Nor does this engine call tools: an answer that ignored them would be a different one.
    tools_field = tools_requested(data)
    if tools_field is not None:
        raise OpenAIError("tool calling is not supported by this engine", param=tools_field)


def _is_text_prompt(prompt: Any) -> bool:
    """A string, or a one-element list holding one (ids are not text)."""
    one = isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)
    return isinstance(prompt, str) or one


def _completion_prompt(prompt: Any, tokenizer: Tokenizer) -> np.ndarray:
    if prompt is None:
        raise OpenAIError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if not isinstance(prompt, list):
        raise OpenAIError(
            "prompt must be a string, an array of token ids, or an array of one prompt", param="prompt"
        )
    if not prompt:
        raise OpenAIError("prompt must not be empty", param="prompt")
    # Looking at the first element only keeps long token-id prompts off a per-element Python loop;
    # token_ids_param then checks every element in C.
    if isinstance(prompt[0], int):
        return token_ids_param(prompt, "prompt")
    if len(prompt) > 1:
        raise OpenAIError("only one prompt per request is supported", param="prompt")
    only = prompt[0]
    if isinstance(only, str):
        return tokenizer.encode(only)
    if isinstance(only, list):
        return token_ids_param(only, "prompt")
    raise OpenAIError(
        "prompt must be a string, an array of token ids, or an array of one prompt", param="prompt"
    )


def _render_messages(data: dict[str, Any], tokenizer: Tokenizer) -> str:
    messages = data.get("messages")
    if messages is None:
        raise OpenAIError("messages is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty array", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise OpenAIError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise OpenAIError(f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role")
    try:
        # vLLM's rendering (text parts joined with "\n", developer -> system for a template without that
        # role): the most common engine's, and the gateway renders so in front of kvgate's engines too.
        # With the template's other inputs as vLLM takes them (chat_template_kwargs, add_generation_prompt,
        # continue_final_message, documents), so that the gateway's rendering of the chat is this one.
        return render_messages(tokenizer, messages, dialect=VLLM, inputs=VLLM.chat_inputs(data))
    except ChatContentError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
