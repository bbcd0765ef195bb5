"""The chat one conversation of a ``/v1/embeddings`` request is rendered as (vLLM 0.32's
EmbeddingChatRequest): a chat's template options taken from the request, and no generation prompt unless it
asks for one. The gateway counts such a conversation with it and kvgate's engine embeds it with it, so that
both render the same prompt."""

from __future__ import annotations

from typing import Any

# The template options an embeddings chat takes from its body (vLLM's ChatRequestOptionsMixin, bar
# chat_template, which engines refuse).
TEMPLATE_OPTIONS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def embedding_chat_body(body: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body that renders ``messages`` for an embedding: the request's template options (null is
    the default), ``add_generation_prompt`` false unless the request says otherwise."""
    chat: dict[str, Any] = {name: body[name] for name in TEMPLATE_OPTIONS if body.get(name) is not None}
    chat.setdefault("add_generation_prompt", False)
    chat["messages"] = messages
    return chat
