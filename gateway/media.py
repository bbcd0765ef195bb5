"""Chats and Responses inputs with media (images, audio, files) in them, as the gateway reads them.

A multimodal engine (vLLM serving a vision model, say) takes OpenAI's media content parts, which the gateway
does not render: it cannot tell how many tokens an image becomes, nor hash them as the engine does. Such a
request is forwarded as the client wrote it, and routed and admitted by its text alone (``media_free_chat``,
``media_free_responses``): its blocks are not hashed, and the prompt tokens the engine reports past the text
are charged when the answer is done. Only requests that carry media take this way: a text chat is rendered
once, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cache.chat_dialect import media_free


def media_free_chat(chat: Mapping[str, Any]) -> dict[str, Any]:
    """A chat body whose messages keep their text parts only (a copy: the client's body is forwarded)."""
    messages = chat.get("messages")
    if not isinstance(messages, list):
        return dict(chat)
    return {**chat, "messages": [_message(m, "content") for m in messages]}


def media_free_responses(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Responses body whose input items keep their text parts only: a message's content, a tool output's
    parts (a copy, as ``media_free_chat``)."""
    items = body.get("input")
    if not isinstance(items, list):
        return dict(body)
    return {**body, "input": [_message(_message(item, "content"), "output") for item in items]}


def _message(item: Any, key: str) -> Any:
    """``item`` with the content array under ``key`` (if it is one) without its media parts."""
    if isinstance(item, Mapping) and isinstance(item.get(key), list):
        return {**item, key: media_free(item[key])}
    return item
