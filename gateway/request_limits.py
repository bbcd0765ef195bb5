"""What a request may ask for, read before and as the engines read it: counts bounded before validation, and
its output budget."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gateway.config import GatewaySettings
from gateway.http.errors import InvalidRequest

RESPONSES_PATH = "/v1/responses"
EMBEDDINGS_PATH = "/v1/embeddings"


def check_counts(settings: GatewaySettings, messages: Any, field: str = "messages") -> None:
    """Bounds that cost nothing to check, before validation whose cost grows with what they bound: a body
    of a quarter million empty messages is small on the wire and would take seconds to validate."""
    if not isinstance(messages, list):
        return  # (validation says what is wrong)
    limit = settings.max_messages
    if len(messages) > limit:
        raise InvalidRequest(
            f"{field} has {len(messages)} items; this gateway allows at most {limit}", param=field
        )
    check_content_parts(settings, messages, field)


def check_content_parts(settings: GatewaySettings, messages: Iterable[Any], field: str) -> None:
    """A chat's bound on the content parts of ``messages`` (any of them, wherever they come from), all
    together: each is validated and rendered, which costs time by the part."""
    parts = sum(
        len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if parts > settings.max_content_parts:
        raise InvalidRequest(
            f"{field} holds {parts} content parts in all; this gateway allows at most "
            f"{settings.max_content_parts}",
            param=field,
        )


def check_prompt_count(settings: GatewaySettings, prompt: list[Any]) -> None:
    """A completion's prompts (each one a request to an engine), bounded before they are validated. A list
    of token ids is one prompt, whatever its length."""
    if prompt and isinstance(prompt[0], str | list) and len(prompt) > settings.max_prompts:
        raise InvalidRequest(
            f"prompt holds {len(prompt)} prompts; this gateway allows at most {settings.max_prompts} per "
            "request",
            param="prompt",
        )


def output_budget(settings: GatewaySettings, body: dict[str, Any], path: str) -> tuple[int, str, bool]:
    """(tokens per choice the engine will generate at most, the parameter that says so, whether the
    engine is told), read as the engines read it: chat takes ``max_completion_tokens`` over
    ``max_tokens``; legacy completions know only ``max_tokens``.

    A completion naming none gets ``default_max_tokens`` (OpenAI's 16), written into ``body`` so that
    no engine's own default decides instead. A chat naming none is OpenAI's "as long as the context
    allows": it is sent without one unless ``default_chat_max_tokens`` is set (a fixed budget could only
    be wrong: past an engine's context, vLLM refuses the request); admission then charges
    ``default_max_tokens`` and the tokens generated past it are charged when the answer is done."""
    if path == EMBEDDINGS_PATH:
        return 0, "max_tokens", True  # (an embedding decodes nothing)
    chat = path != "/v1/completions"  # (a Responses request budgets as a chat does)
    if path == RESPONSES_PATH:
        param = "max_output_tokens"
    elif chat and body.get("max_completion_tokens") is not None:
        param = "max_completion_tokens"
    else:
        if body.get("max_completion_tokens") is not None:
            raise InvalidRequest(
                "max_completion_tokens is not a parameter of /v1/completions; use max_tokens",
                param="max_completion_tokens",
            )
        param = "max_tokens"
    requested = body.get(param)
    if isinstance(requested, int):  # (the schema checked its type when present)
        return requested, param, True
    s = settings
    if not chat:
        default = s.default_max_tokens
    elif s.default_chat_max_tokens is not None:
        default = s.default_chat_max_tokens
    else:
        return s.default_max_tokens, param, False  # sent without one; admission's charge
    body[param] = default
    return default, param, True
