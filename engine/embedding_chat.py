"""The chat forms of a ``/v1/embeddings`` request, as vLLM 0.32 takes them (its EmbeddingChatRequest and the
batch and ``input`` variants of it): conversations rendered by the chat template that kvgate's engines use
for chats, each embedded as one input.

Forms: ``messages`` as one conversation (an array of messages) or as an array of conversations; ``input`` as
one conversation or as an array of conversations. A conversation is rendered as the gateway counts it
(``cache.embedding_chat``): with vLLM's template inputs ``add_generation_prompt`` (false by default for
embeddings), ``continue_final_message`` and ``chat_template_kwargs``, and without tools. Its
tokens get the tokenizer's special tokens only when ``add_special_tokens`` is true (false by default for
chats: the template writes its own). A ``chat_template`` in the request is refused, as vLLM refuses one
unless started with ``--trust-request-chat-template``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cache.chat_dialect import VLLM, ChatContentError
from cache.chat_template import render_messages
from cache.embedding_chat import embedding_chat_body
from cache.tokens import Tokenizer
from engine.openai_errors import OpenAIError
from engine.openai_params import bool_param


def chat_conversations(data: dict[str, Any]) -> tuple[str, list[list[dict[str, Any]]]] | None:
    """``(field, conversations)`` when the request embeds chats (``field``: "messages" or "input", the
    parameter its errors name), or None for text and token-id inputs. Each conversation is a non-empty array
    of message objects with a role; what else is wrong with one is found where it is rendered."""
    messages = data.get("messages")
    if messages is not None:
        if data.get("input") is not None:
            raise OpenAIError("give either input or messages, not both", param="messages")
        return "messages", _conversations(messages, "messages")
    value = data.get("input")
    if isinstance(value, list) and value and _looks_like_chat(value[0]):
        return "input", _conversations(value, "input")
    return None


def _looks_like_chat(first: Any) -> bool:
    """An input whose first item is a message, or a non-empty list starting with one."""
    return isinstance(first, dict) or (isinstance(first, list) and bool(first) and isinstance(first[0], dict))


def _conversations(value: Any, field: str) -> list[list[dict[str, Any]]]:
    if not isinstance(value, list) or not value:
        raise OpenAIError(f"{field} must be a non-empty array", param=field)
    if all(isinstance(item, dict) for item in value):
        conversations = [value]
        where = [field]
    elif all(isinstance(item, list) for item in value):
        conversations = value
        where = [f"{field}[{i}]" for i in range(len(value))]
    else:  # (conversations mixed with messages, texts or token ids)
        message = f"{field} must be a conversation (an array of messages) or an array of conversations"
        raise OpenAIError(message, param=field)
    for conversation, name in zip(conversations, where, strict=True):
        if not conversation:
            raise OpenAIError(f"{name} must be a non-empty array of messages", param=field)
        for i, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise OpenAIError(f"{name}[{i}] must be a message object", param=field)
            role = message.get("role")
            if not isinstance(role, str) or not role:
                raise OpenAIError(f"{name}[{i}].role must be a non-empty string", param=field)
    return conversations


def render_conversations(
    data: dict[str, Any], field: str, conversations: list[list[dict[str, Any]]], tokenizer: Tokenizer
) -> list[np.ndarray]:
    """The token ids of each conversation as the chat template renders it for an embedding (special tokens
    added only when ``add_special_tokens`` is true), before truncation."""
    if data.get("chat_template") is not None:
        raise OpenAIError(  # vLLM's default (--trust-request-chat-template unset)
            "a chat_template given in the request is not accepted by this engine; it renders conversations "
            "with the model's own",
            param="chat_template",
        )
    bool_param(data.get("add_generation_prompt"), "add_generation_prompt", default=False)  # (400: no bool)
    add_special = bool_param(data.get("add_special_tokens"), "add_special_tokens", default=False)
    try:
        inputs = VLLM.chat_inputs(embedding_chat_body(data, []))
        texts = [
            render_messages(tokenizer, messages, dialect=VLLM, inputs=inputs) for messages in conversations
        ]
    except ChatContentError as exc:
        param = exc.param if exc.param != "messages" else field
        raise OpenAIError(str(exc), param=param) from None
    prompts = [tokenizer.encode(text) for text in texts]
    if add_special:
        prompts = [tokenizer.with_special_tokens(ids) for ids in prompts]
    return prompts
