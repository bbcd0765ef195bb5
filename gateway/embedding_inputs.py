"""The inputs of an embeddings request (``POST /v1/embeddings``), read in every form vLLM 0.32 takes, so that
admission can count their tokens.

An embedding is a prefill with nothing decoded, and engines report no cached tokens for one (vLLM's usage
is ``prompt_tokens`` and ``total_tokens`` only), so the gateway does not hash its inputs: the request is
routed by load and session, and its inputs go to one engine as the client sent them, as vLLM takes a batch
in one request (a request per input would cost thousands of requests for nothing to gain).

Forms: ``input`` as a string, a list of strings, a list of token ids or a list of such lists (OpenAI's);
and vLLM's chat forms, one conversation or a list of them, in ``messages`` or in ``input``, rendered by the
model's chat template (with ``add_generation_prompt`` false unless the request says otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cache.embedding_chat import embedding_chat_body
from cache.tokens import Tokenizer
from gateway.config import GatewaySettings
from gateway.http.errors import InvalidRequest
from gateway.request_limits import check_content_parts
from gateway.schemas import EmbeddingsRequest, check_conversation

# Binary answers (vLLM's "bytes", "bytes_only") carry no JSON usage to bill from.
JSON_ENCODINGS = ("float", "base64")
_INPUT_FORMS = (
    "must be a non-empty string, an array of strings, an array of token ids (integers in [0, 2**32)), an "
    "array of such arrays, or a conversation (an array of messages)"
)


@dataclass(frozen=True, slots=True)
class EmbeddingInputs:
    """What the engine embeds, in the client's order: texts (tokenized with the model's special tokens
    unless ``add_special_tokens`` is false), token id lists (taken as they are) and conversations."""

    texts: list[str]
    token_ids: list[list[int]]
    conversations: list[tuple[str, list[dict[str, Any]]]]  # (where it is in the body, its messages)
    field: str  # "input" or "messages": the parameter an error names

    @property
    def count(self) -> int:
        return len(self.texts) + len(self.token_ids) + len(self.conversations)


def embedding_inputs(settings: GatewaySettings, body: dict[str, Any]) -> EmbeddingInputs:
    """The request's inputs, bounded by ``gateway.max_embedding_inputs`` before anything else is read
    (their shape only: a message's own fields are checked where it is rendered)."""
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in JSON_ENCODINGS:
        raise InvalidRequest(
            f"encoding_format must be one of {', '.join(repr(e) for e in JSON_ENCODINGS)} through this "
            f"gateway, not {str(encoding)[:40]!r}",
            param="encoding_format",
        )
    if body.get("messages") is not None:  # (null is absent, as vLLM and kvgate's engine read it)
        if body.get("input") is not None:
            raise InvalidRequest("give either input or messages, not both", param="messages")
        field, value = "messages", body["messages"]
    elif "input" in body:
        field, value = "input", body["input"]
    else:
        raise InvalidRequest("input: field required", param="input")
    out = EmbeddingInputs([], [], [], field)
    if isinstance(value, str) and field == "input":
        if not value:
            raise InvalidRequest("input must not be an empty string", param="input")
        out.texts.append(value)
        return out
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{field} {_INPUT_FORMS}", param=field)
    if _is_conversation(value):  # one conversation
        out.conversations.append((field, value))
        _check_messages(settings, out, field)
        return out
    if len(value) > settings.max_embedding_inputs and not _is_int(value[0]):
        raise InvalidRequest(
            f"{field} holds {len(value)} inputs; this gateway allows at most {settings.max_embedding_inputs} "
            "per request",
            param=field,
        )
    if field == "input" and all(_is_int(t) for t in value):  # one prompt of token ids
        out.token_ids.append(_token_ids(value, field))
        return out
    for i, item in enumerate(value):
        where = f"{field}.{i}"
        if isinstance(item, str) and field == "input":
            if not item:
                raise InvalidRequest(f"{where} must not be an empty string", param=field)
            out.texts.append(item)
        elif isinstance(item, list) and item and _is_conversation(item):
            out.conversations.append((where, item))
        elif isinstance(item, list) and item and field == "input" and all(_is_int(t) for t in item):
            out.token_ids.append(_token_ids(item, where))
        else:
            raise InvalidRequest(f"{where}: each of {field}'s items {_INPUT_FORMS}", param=field)
    if out.conversations and (out.texts or out.token_ids):
        raise InvalidRequest(f"{field} mixes conversations with other inputs", param=field)
    _check_messages(settings, out, field)
    return out


def _check_messages(settings: GatewaySettings, inputs: EmbeddingInputs, field: str) -> None:
    """A chat's bounds on messages and on content parts, for all the conversations together (each is
    validated and rendered, which costs time by the part: 300,000 parts in 8 MB took over a second)."""
    messages = sum(len(conversation) for _, conversation in inputs.conversations)
    if messages > settings.max_messages:
        raise InvalidRequest(
            f"{field} holds {messages} messages in all; this gateway allows at most {settings.max_messages}",
            param=field,
        )
    every_message = (m for _, conversation in inputs.conversations for m in conversation)
    check_content_parts(settings, every_message, field)


def embedding_tokens(
    tokenizer: Tokenizer,
    render: Callable[[str, dict[str, Any]], str],
    parsed: EmbeddingsRequest,
    body: dict[str, Any],
    inputs: EmbeddingInputs,
) -> np.ndarray:
    """Every input's tokens, one after the other, as the engine counts them: texts with the model's special
    tokens (vLLM's ``add_special_tokens``, true by default, false for conversations), conversations as
    ``render`` (model, chat body) renders them, each cut to ``truncate_prompt_tokens`` when that is set. The
    texts are encoded in one batch call, off the GIL: a thread may run this."""
    texts = list(inputs.texts)
    for where, messages in inputs.conversations:
        check_conversation(messages, where)
        texts.append(render(parsed.model, embedding_chat_body(body, messages)))
    encoded = tokenizer.encode_many(texts)
    special = parsed.add_special_tokens
    if special is True or (special is None and not inputs.conversations):
        encoded = [tokenizer.with_special_tokens(ids) for ids in encoded]
    prompts = [*encoded, *(np.asarray(ids, dtype=np.uint32) for ids in inputs.token_ids)]
    keep = parsed.truncate_prompt_tokens
    if keep is not None and keep >= 0:  # (-1: the engine's context, which only the engine knows)
        left = body.get("truncation_side") == "left"
        prompts = [ids[len(ids) - keep :] if left else ids[:keep] for ids in prompts]
    return np.concatenate(prompts)


def _is_conversation(value: list[Any]) -> bool:
    return all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(ids: list[Any], where: str) -> list[int]:
    if not all(0 <= t < 2**32 for t in ids):
        raise InvalidRequest(f"{where}: token ids must be integers in [0, 2**32)", param=where.split(".")[0])
    return ids
