"""The OpenAI response bodies a kvgate engine writes: usage, whole answers, SSE chunks, model lists, and the
``logprobs`` object of a choice (chat's ``content`` list or completions' parallel arrays)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from cache.tokens import Tokenizer
from engine.engine_types import TokenLogprob
from engine.openai_api import (
    SSE_CONTENT_TYPE,
    SSE_DONE,
    FinishReason,
    GenerationRequest,
    RequestKind,
)

MIN_LOGPROB = -9999.0  # as vLLM: JSON has no -inf


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The usage object; ``cached_tokens`` is what the engine really found cached, and what gets billed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class LogprobsFormatter:
    """One choice's tokens as OpenAI ``logprobs`` objects, piece by piece (a streamed chunk, or the whole
    answer at once). Tokens are shown as they decode alone (special tokens as ""), with their UTF-8 bytes;
    completions' ``text_offset`` counts those strings from the start of the choice's text."""

    __slots__ = ("_kind", "_offset", "_tok")

    def __init__(self, kind: RequestKind, tokenizer: Tokenizer) -> None:
        self._kind = kind
        self._tok = tokenizer
        self._offset = 0

    def _text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def render(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        if self._kind == "chat":
            return {"content": [self._chat_entry(e) for e in entries]}
        tokens, logprobs, tops, offsets = [], [], [], []
        for e in entries:
            text = self._text(e.token_id)
            tokens.append(text)
            logprobs.append(max(e.logprob, MIN_LOGPROB))
            # The top k and the chosen token: up to k + 1 entries, as OpenAI. Tokens that decode alike
            # (pieces of one character) share a key: the chosen one's logprob wins, as token_logprobs says.
            top = {self._text(t): max(lp, MIN_LOGPROB) for t, lp in e.top}
            top[text] = max(e.logprob, MIN_LOGPROB)
            tops.append(top)
            offsets.append(self._offset)
            self._offset += len(text)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, e: TokenLogprob) -> dict[str, Any]:
        text = self._text(e.token_id)
        return {
            "token": text,
            "logprob": max(e.logprob, MIN_LOGPROB),
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (t := self._text(tid)), "logprob": max(lp, MIN_LOGPROB), "bytes": list(t.encode())}
                for tid, lp in e.top
            ],
        }


@dataclass(frozen=True, slots=True)
class ChoiceBody:
    """One finished choice of a whole answer."""

    index: int
    text: str
    finish_reason: FinishReason
    logprobs: dict[str, Any] | None = None


def response_body(
    req: GenerationRequest,
    text: str,
    finish_reason: FinishReason,
    usage_obj: Mapping[str, Any],
    *,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    """The non-streaming body of one choice: a ``text_completion`` or a ``chat.completion``."""
    return choices_body(req, [ChoiceBody(0, text, finish_reason, logprobs)], usage_obj)


def choices_body(
    req: GenerationRequest, choices: Sequence[ChoiceBody], usage_obj: Mapping[str, Any]
) -> bytes:
    """The non-streaming body of any number of choices."""
    out: list[dict[str, Any]] = []
    for c in choices:
        if req.kind == "chat":
            out.append(
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": c.logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
        else:
            out.append(
                {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            )
    return orjson.dumps(
        {
            "id": req.response_id,
            "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": req.created,
            "model": req.model,
            "choices": out,
            "usage": usage_obj,
        }
    )


class SseFormatter:
    """The SSE byte chunks of one streamed response.

    Token chunks of choice 0 without logprobs are spliced from a prefix and suffix built once per request,
    so a token costs one small ``orjson.dumps`` of its text instead of serialising a whole dict. With
    several choices, each gets its own finish chunk (``finish_choice``) and ``end`` closes the stream.
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
        """What goes out before the first token: chat announces the assistant role (of every choice),
        completions nothing."""
        if self._req.kind != "chat":
            return b""
        return b"".join(
            b"data: " + self._head + b',"choices":[{"index":' + str(index).encode() + b","
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
            for index in range(self._req.n)
        )

    def token(self, text: str, index: int = 0, logprobs: dict[str, Any] | None = None) -> bytes:
        """A chunk of new text of choice ``index``, with its tokens' ``logprobs`` object if asked for."""
        if index == 0 and logprobs is None:
            return self._prefix + orjson.dumps(text) + self._suffix
        return self._chunk(self._choice(index, text, logprobs, None))

    def _choice(
        self, index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: FinishReason | None
    ) -> dict[str, Any]:
        if self._req.kind == "chat":
            delta = {"content": text} if text or finish_reason is None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        return b"data: " + self._head + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"

    def finish_choice(
        self, finish_reason: FinishReason, index: int = 0, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        """The chunk carrying choice ``index``'s finish_reason (and the logprobs of tokens that brought no
        text, if any)."""
        return self._chunk(self._choice(index, "", logprobs, finish_reason))

    def end(self, usage_obj: Mapping[str, Any]) -> bytes:
        """The usage chunk if asked for, and ``[DONE]``."""
        out = []
        if self._req.include_usage:
            out.append(
                b"data: " + self._head + b',"choices":[],"usage":' + orjson.dumps(usage_obj) + b"}\n\n"
            )
        out.append(SSE_DONE)
        return b"".join(out)

    def finish(self, finish_reason: FinishReason, usage_obj: Mapping[str, Any]) -> bytes:
        """The chunk carrying finish_reason, the usage chunk if asked for, and ``[DONE]``: the end of a
        one-choice stream."""
        return self.finish_choice(finish_reason) + self.end(usage_obj)


def models_body(model: str, created: int) -> bytes:
    return orjson.dumps({"object": "list", "data": [model_object(model, created)]})


def model_object(model: str, created: int) -> dict[str, Any]:
    """The served model as ``/v1/models`` lists it and ``/v1/models/{model}`` answers it."""
    return {"id": model, "object": "model", "created": created, "owned_by": "kvgate"}


def sse_response(headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """A not yet prepared SSE response; the caller prepares it when the first bytes are ready."""
    resp = web.StreamResponse(headers=headers)
    resp.content_type = SSE_CONTENT_TYPE
    resp.headers["Cache-Control"] = "no-cache"
    return resp
