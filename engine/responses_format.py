"""The Responses API's answers as vLLM 0.32 writes them for a model without Harmony or parsers: the Response
object (one assistant message of one ``output_text`` part), and a streamed one's SSE events, each
``event: <type>`` with its JSON and a ``sequence_number`` (and no ``[DONE]``, as neither OpenAI nor vLLM
sends one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from cache.tokens import Tokenizer
from engine.engine_types import StepOutput, TokenLogprob
from engine.openai_api import new_id
from engine.openai_format import LogprobsFormatter
from engine.responses_request import ResponsesRequest

MESSAGE_ID_PREFIX = "msg_"


def usage_object(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    """``cached_tokens`` is what the engine found cached, and what gets billed (vLLM writes no cache
    writes nor reasoning tokens for such a model either)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    req: ResponsesRequest,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """The Response: what was generated, with the request's fields echoed as vLLM's from_request does
    (sampling values as used, ``max_output_tokens`` the budget the generation had)."""
    body, params = req.body, req.gen.params
    parallel_tool_calls = body.get("parallel_tool_calls")
    return {
        "id": req.id,
        "object": "response",
        "created_at": req.gen.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": params.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata"),
        "model": req.gen.model,
        "output": output,
        "parallel_tool_calls": True if parallel_tool_calls is None else parallel_tool_calls,
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": body.get("reasoning"),
        "service_tier": body.get("service_tier") or "auto",
        "store": req.store,
        "temperature": params.temperature,
        "text": body.get("text"),
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [],
        "top_logprobs": params.logprobs,
        "top_p": params.top_p,
        "truncation": body.get("truncation") or "disabled",
        "usage": usage,
        "user": body.get("user"),
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
    }


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, parts: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}


def status_of(out: StepOutput) -> str:
    """``incomplete`` when the budget (``max_output_tokens``, or the context) cut the answer."""
    return "incomplete" if out.finish_reason == "length" else "completed"


class WholeResponse:
    """The non-streamed answer: feed it every output, then take its ``response``."""

    def __init__(self, req: ResponsesRequest, tokenizer: Tokenizer) -> None:
        self._req = req
        self._lp = LogprobsFormatter("chat", tokenizer) if req.logprobs else None
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: StepOutput | None = None

    def add(self, out: StepOutput) -> None:
        self._text.append(out.text)
        self._logprobs.extend(out.logprobs)
        self._last = out

    def response(self) -> dict[str, Any]:
        out = self._last
        assert out is not None
        text = "".join(self._text)
        logprobs = self._lp.render(self._logprobs)["content"] if self._lp is not None else None
        # (vLLM: a message without text has no part)
        parts = [output_text(text, logprobs)] if text else []
        usage = usage_object(out.prompt_tokens, out.cached_tokens, out.completion_tokens)
        item = message_item(new_id(MESSAGE_ID_PREFIX), parts)
        return response_object(self._req, status=status_of(out), output=[item], usage=usage)


class StreamedResponse:
    """The SSE events of a streamed answer: ``start()``, ``add`` of every output, then ``finish()``.

    As vLLM's: the message item opens with the first text (an answer without text has no item), each
    output's text is one ``response.output_text.delta``, and ``response.completed`` carries the whole
    Response, usage included, also when the budget cut it (its status then says ``incomplete``).
    """

    def __init__(self, req: ResponsesRequest, tokenizer: Tokenizer) -> None:
        self._req = req
        self._lp = LogprobsFormatter("chat", tokenizer) if req.logprobs else None
        self._seq = 0
        self._item_id: str | None = None
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._pending: list[TokenLogprob] = []  # of tokens whose text is still held back
        self._last: StepOutput | None = None
        self.response: dict[str, Any] | None = None  # the finished Response, once ``finish`` made it

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._item_id, "output_index": 0, "content_index": 0}

    def start(self) -> bytes:
        initial = response_object(self._req, status="in_progress", output=[], usage=None)
        return self._event("response.created", {"response": initial}) + self._event(
            "response.in_progress", {"response": initial}
        )

    def add(self, out: StepOutput) -> bytes:
        self._last = out
        self._pending.extend(out.logprobs)
        if not out.text:
            return b""
        events = []
        if self._item_id is None:
            self._item_id = new_id(MESSAGE_ID_PREFIX)
            item = message_item(self._item_id, [], status="in_progress")
            events.append(self._event("response.output_item.added", {"output_index": 0, "item": item}))
            events.append(
                self._event("response.content_part.added", {**self._where(), "part": output_text("", [])})
            )
        logprobs = self._take_logprobs()
        self._text.append(out.text)
        delta = {**self._where(), "delta": out.text, "logprobs": _delta_logprobs(logprobs)}
        events.append(self._event("response.output_text.delta", delta))
        return b"".join(events)

    def _take_logprobs(self) -> list[dict[str, Any]]:
        if self._lp is None or not self._pending:
            return []
        entries: Sequence[TokenLogprob]
        entries, self._pending = self._pending, []
        rendered: list[dict[str, Any]] = self._lp.render(entries)["content"]
        self._logprobs.extend(rendered)
        return rendered

    def finish(self) -> bytes:
        """The events closing the message (if one opened) and ``response.completed``."""
        out = self._last
        assert out is not None
        events = []
        output = []
        if self._item_id is not None:
            self._take_logprobs()  # (those of tokens that brought no text go with the part)
            text = "".join(self._text)
            part = output_text(text, self._logprobs or None)
            item = message_item(self._item_id, [part])
            done = {**self._where(), "text": text, "logprobs": []}
            events.append(self._event("response.output_text.done", done))
            events.append(self._event("response.content_part.done", {**self._where(), "part": part}))
            events.append(self._event("response.output_item.done", {"output_index": 0, "item": item}))
            output.append(item)
        usage = usage_object(out.prompt_tokens, out.cached_tokens, out.completion_tokens)
        self.response = response_object(self._req, status=status_of(out), output=output, usage=usage)
        events.append(self._event("response.completed", {"response": self.response}))
        return b"".join(events)

    def error(self, message: str, code: str | None) -> bytes:
        """An ``error`` event: the engine failed after the stream began."""
        return self._event("error", {"code": code, "message": message, "param": None})


def _delta_logprobs(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A delta event's logprobs: an output_text part's, without the bytes (vLLM's _to_stream_logprobs)."""
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]],
        }
        for e in rendered
    ]
