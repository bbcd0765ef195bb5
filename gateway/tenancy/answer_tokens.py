"""The gateway's own count of what an engine generated in a whole answer, for billing an answer whose usage
is missing or not credible (``gateway.tenancy.billing.credible_counts``). A stream's tokens are counted as
its events go by; a whole answer's were not counted at all, so such an answer was billed 0 completion
tokens however long it was. Its generated text (choices' text, messages' content, reasoning and tool calls,
a Responses answer's output) is tokenized off the event loop with the gateway's tokenizer: an estimate, and
the record says so."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from cache.tokens import Tokenizer
from gateway.tenancy.billing import credible_counts

MESSAGE_TEXT = ("content", "reasoning_content", "reasoning", "refusal")


def own_completion_count(
    tokenizer: Tokenizer, answer: dict[str, Any], usage: dict[str, Any] | None
) -> Awaitable[int] | None:
    """The count of ``answer``'s generated tokens, when its ``usage`` cannot bill it; None when it can
    (or when it generated no text), so that answers with their usage pay nothing for this."""
    if usage is not None and credible_counts(usage) is not None:
        return None
    texts = generated_texts(answer)
    if not texts:
        return None
    return asyncio.get_running_loop().run_in_executor(None, _count, tokenizer, texts)


def _count(tokenizer: Tokenizer, texts: list[str]) -> int:
    return sum(len(ids) for ids in tokenizer.encode_many(texts))


def generated_texts(answer: dict[str, Any]) -> list[str]:
    """Every text the engine generated in a completions, chat completions or Responses answer."""
    texts: list[str] = []
    for choice in _dicts(answer.get("choices")):
        _add(texts, choice.get("text"))  # (completions)
        message = choice.get("message")
        if isinstance(message, dict):  # (chat completions)
            for field in MESSAGE_TEXT:
                _add(texts, message.get(field))
            for call in _dicts(message.get("tool_calls")):
                function = call.get("function")
                if isinstance(function, dict):
                    _add(texts, function.get("name"))
                    _add(texts, function.get("arguments"))
    for item in _dicts(answer.get("output")):  # (Responses: messages, reasoning, function calls)
        if item.get("type") == "function_call":
            _add(texts, item.get("name"))
            _add(texts, item.get("arguments"))
        for part in [*_dicts(item.get("content")), *_dicts(item.get("summary"))]:
            _add(texts, part.get("text"))
    return texts


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _add(texts: list[str], value: Any) -> None:
    if isinstance(value, str) and value:
        texts.append(value)
