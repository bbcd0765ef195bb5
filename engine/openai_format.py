"""The OpenAI response bodies a kvgate engine writes: usage, whole answers, SSE chunks, model lists."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web

from engine.openai_api import (
    SSE_CONTENT_TYPE,
    SSE_DONE,
    FinishReason,
    GenerationRequest,
)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The usage object; ``cached_tokens`` is what the engine really found cached, and what gets billed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def response_body(
    req: GenerationRequest, text: str, finish_reason: FinishReason, usage_obj: Mapping[str, Any]
) -> bytes:
    """The non-streaming body: a ``text_completion`` or a ``chat.completion``."""
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return orjson.dumps(
        {
            "id": req.response_id,
            "object": obj,
            "created": req.created,
            "model": req.model,
            "choices": [choice],
            "usage": usage_obj,
        }
    )


class SseFormatter:
    """The SSE byte chunks of one streamed response.

    Token chunks are spliced from a prefix and suffix built once per request, so a token costs one small
    ``orjson.dumps`` of its text instead of serialising a whole dict.
    """

    __slots__ = ("_head", "_prefix", "_req", "_suffix")

    def __init__(self, req: GenerationRequest) -> None:
        self._req = req
        obj = b"chat.completion.chunk" if req.kind == "chat" else b"text_completion"
        self._head = (
            b'{"id":'
            + orjson.dumps(req.response_id)
            + b',"object":"'
            + obj
            + b'","created":'
            + str(req.created).encode()
            + b',"model":'
            + orjson.dumps(req.model)
        )
        if req.kind == "chat":
            self._prefix = b"data: " + self._head + b',"choices":[{"index":0,"delta":{"content":'
            self._suffix = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._prefix = b"data: " + self._head + b',"choices":[{"index":0,"text":'
            self._suffix = b',"logprobs":null,"finish_reason":null}]}\n\n'

    def start(self) -> bytes:
        """What goes out before the first token: chat announces the assistant role, completions nothing."""
        if self._req.kind != "chat":
            return b""
        return (
            b"data: " + self._head + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def token(self, text: str) -> bytes:
        return self._prefix + orjson.dumps(text) + self._suffix

    def finish(self, finish_reason: FinishReason, usage_obj: Mapping[str, Any]) -> bytes:
        """The chunk carrying finish_reason, the usage chunk if asked for, and ``[DONE]``."""
        if self._req.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = [b"data: " + self._head + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"]
        if self._req.include_usage:
            out.append(
                b"data: " + self._head + b',"choices":[],"usage":' + orjson.dumps(usage_obj) + b"}\n\n"
            )
        out.append(SSE_DONE)
        return b"".join(out)


def models_body(model: str, created: int) -> bytes:
    return orjson.dumps(
        {
            "object": "list",
            "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvgate"}],
        }
    )


def sse_response(headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """A not yet prepared SSE response; the caller prepares it when the first bytes are ready."""
    resp = web.StreamResponse(headers=headers)
    resp.content_type = SSE_CONTENT_TYPE
    resp.headers["Cache-Control"] = "no-cache"
    return resp
