"""A ``POST /v1/responses`` body (the OpenAI Responses API), read as vLLM 0.32 reads one for a model without
Harmony: instructions, the stored conversation of a ``previous_response_id`` and the input become a chat
(``cache.responses_input.responses_chat_body``, as the gateway makes it too), which is then parsed as
``/v1/chat/completions`` parses one, so that both render a conversation alike.

What the engine cannot do (tools, structured output, background mode, conversations) is refused with a
400 naming the field, as the chat path refuses it: an answer that ignored it would be a different one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cache.chat_dialect import ChatContentError
from cache.responses_input import responses_chat_body
from cache.tokens import Tokenizer
from engine.openai_api import (
    DEFAULT_MAX_TOKENS,
    GenerationRequest,
    check_model,
    load_body,
    new_id,
    parse_request,
)
from engine.openai_errors import OpenAIError
from engine.openai_params import PACKED_IDS_FIELD, bool_param, int_param
from engine.openai_sampling import FULL, MAX_CHAT_LOGPROBS
from engine.responses_store import StoredResponse

RESPONSE_ID_PREFIX = "resp_"
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What ``include`` may name (vLLM's ResponsesRequest); only the logprobs change what this engine answers.
INCLUDABLE = frozenset(
    {
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
        "file_search_call.results",
        "message.input_image.image_url",
        LOGPROBS_INCLUDE,
        "reasoning.encrypted_content",
    }
)
# The prompt as the gateway tokenized it: of the input alone when a previous_response_id continues a
# conversation only this engine has stored, so then it is rendered here.
_GATEWAY_PROMPT_FIELDS = ("prompt_token_ids", PACKED_IDS_FIELD)
# The fields of a Responses body that mean what they mean in a chat (vLLM's ResponsesRequest has them), and
# kvgate's gateway extensions: handed to the chat parser as they are (the template's inputs, such as
# chat_template_kwargs, are the chat body's). vLLM ignores fields it does not know.
_CHAT_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "structured_outputs",
    "cache_salt",
    "kv_transfer_params",
    "cache_shared_blocks",
    *_GATEWAY_PROMPT_FIELDS,
)

# A stored response by id, or None.
History = Callable[[str], StoredResponse | None]


@dataclass(slots=True)
class ResponsesRequest:
    """One validated Responses request: the chat to generate (``gen.response_id`` is the response's id)
    and what the Response object echoes of the body."""

    gen: GenerationRequest
    body: dict[str, Any]  # as sent
    messages: list[dict[str, Any]]  # the chat rendered, history included: what a continuation continues
    stream: bool
    store: bool
    logprobs: bool  # ``include`` names message.output_text.logprobs
    previous: StoredResponse | None = None  # the response ``previous_response_id`` continues

    @property
    def id(self) -> str:
        return self.gen.response_id


def not_found(response_id: str) -> OpenAIError:
    """vLLM's answer for an id it has not stored (or never made)."""
    message = f"Response with id '{response_id[:200]}' not found."
    return OpenAIError(message, status=404, param="response_id")


def parse_responses_request(
    body: bytes,
    *,
    served_model: str,
    tokenizer: Tokenizer,
    history: History,
    request_id: str | None = None,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
) -> ResponsesRequest:
    """Validate a Responses body; raises :class:`OpenAIError` for what a client got wrong or the engine
    cannot do, a 404 for a ``previous_response_id`` that ``history`` does not hold."""
    data = load_body(body)
    check_model(data, served_model)
    _reject_unsupported(data)
    stream = bool_param(data.get("stream"), "stream", default=False)
    store = bool_param(data.get("store"), "store", default=True)
    logprobs = _includes_logprobs(data.get("include"))
    top_logprobs = data.get("top_logprobs")
    if top_logprobs is not None and int_param(top_logprobs, "top_logprobs", lo=0) > MAX_CHAT_LOGPROBS:
        raise OpenAIError(f"top_logprobs must lie in [0, {MAX_CHAT_LOGPROBS}]", param="top_logprobs")
    budget = data.get("max_output_tokens")
    if budget is not None:
        budget = int_param(budget, "max_output_tokens", lo=1)
    previous = _previous(data.get("previous_response_id"), history)
    chat = _chat_body(data, previous)
    chat.update((k, data[k]) for k in _CHAT_FIELDS if k in data)
    if previous is not None:
        for field in _GATEWAY_PROMPT_FIELDS:
            chat.pop(field, None)
    if logprobs:  # (vLLM: top_logprobs without the include asks for nothing)
        chat["logprobs"], chat["top_logprobs"] = True, top_logprobs or 0
    try:
        # With no context length here: what the budget may be is decided below, as vLLM decides it.
        gen = parse_request(
            chat,
            "chat",
            served_model=served_model,
            tokenizer=tokenizer,
            request_id=request_id,
            capabilities=FULL,
            vocab_size=vocab_size,
            chat_fills_context=False,
        )
    except OpenAIError as exc:
        if exc.param is not None and exc.param.startswith("messages"):
            exc.param = "input"
        raise
    gen.response_id = new_id(RESPONSE_ID_PREFIX)
    gen.params = replace(gen.params, max_tokens=_max_tokens(gen.prompt_tokens, budget, max_model_len))
    return ResponsesRequest(gen, data, chat["messages"], stream, store, logprobs, previous)


def _chat_body(data: dict[str, Any], previous: StoredResponse | None) -> dict[str, Any]:
    """The chat vLLM renders for the body, continuing ``previous`` if given (its chat, then its output)."""
    history = None if previous is None else previous.messages
    output = None if previous is None else previous.response["output"]
    try:
        chat = responses_chat_body(data, history, output)
    except ChatContentError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
    # (Tools were refused above; a tool_choice of "auto" would have the chat path refuse it for asking.)
    chat.pop("tools", None)
    chat.pop("tool_choice", None)
    return chat


def _max_tokens(prompt_tokens: int, budget: int | None, max_model_len: int | None) -> int:
    """The output budget as vLLM's get_max_tokens sets it: ``max_output_tokens``, cut to what the context
    leaves (vLLM refuses nothing but a prompt that fills it), or without one all that it leaves."""
    if max_model_len is None:
        return budget or DEFAULT_MAX_TOKENS
    if prompt_tokens >= max_model_len:
        raise OpenAIError(
            f"The engine prompt length {prompt_tokens} exceeds the max_model_len {max_model_len}. "
            "Please reduce prompt.",
            param="input",
            code="context_length_exceeded",
        )
    left = max_model_len - prompt_tokens
    return left if budget is None else min(budget, left)


def _reject_unsupported(data: dict[str, Any]) -> None:
    if bool_param(data.get("background"), "background", default=False):
        raise OpenAIError("background mode is not supported by this engine", param="background")
    if data.get("prompt") is not None:
        raise OpenAIError("prompt template is not supported", param="prompt")  # (vLLM's words)
    if data.get("conversation") is not None:
        message = (
            "conversations are not supported by this engine: send previous_response_id or the whole input"
        )
        raise OpenAIError(message, param="conversation")
    text = data.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise OpenAIError("text must be an object", param="text")
        fmt = text.get("format")
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            raise OpenAIError('only text.format {"type": "text"} is supported', param="text.format")
    metadata = data.get("metadata")  # (kept and echoed back: OpenAI's and vLLM's, a map of strings)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise OpenAIError("metadata must be an object whose values are strings", param="metadata")
    # As the chat path: this engine calls no tools, and an answer that ignored them would be a different one.
    tools = data.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise OpenAIError("tools must be an array", param="tools")
    if tools:
        raise OpenAIError("tool calling is not supported by this engine", param="tools")
    if data.get("tool_choice") not in (None, "none", "auto"):
        raise OpenAIError("tool calling is not supported by this engine", param="tool_choice")


def _includes_logprobs(include: Any) -> bool:
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise OpenAIError("include must be an array of strings", param="include")
    for value in include:
        if value not in INCLUDABLE:
            raise OpenAIError(f"include cannot name {value[:100]!r}", param="include")
    return LOGPROBS_INCLUDE in include


def _previous(response_id: Any, history: History) -> StoredResponse | None:
    if response_id is None:
        return None
    if not isinstance(response_id, str):
        raise OpenAIError("previous_response_id must be a string", param="previous_response_id")
    stored = history(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored
