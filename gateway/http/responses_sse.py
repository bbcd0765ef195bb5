"""Relaying a Responses API stream (``POST /v1/responses`` with ``stream: true``): events pass through as
they come; the tap notes where the response is kept (its id, in ``response.created``), its usage and its end.

A Responses stream has no ``[DONE]`` (OpenAI and vLLM send none): it ends with one terminal event,
``response.completed``, ``response.incomplete`` (cut by its budget, still whole) or ``response.failed``,
whose ``response`` carries the usage. Each event has an ``event:`` line and a data line whose JSON ``type``
names it too; the tap reads the type from the data, which every server sends. Events are only split and
parsed when a batch holds one the tap needs; text deltas are counted where they pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from gateway.http.sse import Annotate, count_events, data_of, last_event_end, split_events

# The events the tap reads: the response's first announcement, its terminal events, and an error. (A type
# is at the top level of an event's data; inside a string a quote is escaped, so `"type":"` is never text.)
# An engine's error may also come as chat streams send it: ``data: {"error": {...}}`` (the gateway's own too).
_READ = re.compile(
    rb'"type": ?"(?:response\.(?:created|in_progress|completed|incomplete|failed)|error)"|data: ?\{"error"'
)
_DELTA = re.compile(rb'"type": ?"response\.[a-z_.]+\.delta"')  # a piece of output: about one token each
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

OnResponse = Callable[[dict[str, Any]], object]  # the response object, as first announced


class ResponsesStreamTap:
    """The relay's tap (``gateway.http.relay.StreamTap``) for a Responses stream."""

    end_marker = "a response.completed event"  # (the relay's words for a stream that ended without it)

    def __init__(self, *, annotate: Annotate | None = None, on_response: OnResponse | None = None) -> None:
        self._annotate = annotate
        self._on_response = on_response
        self._tail = bytearray()
        self.usage: dict[str, Any] | None = None
        self.final_usage: dict[str, Any] | None = None  # the terminal event's
        self.error: dict[str, Any] | None = None  # an error event's, or a failed response's
        self.saw_done = False  # its terminal event came: the stream is whole
        self.response_id: str | None = None
        self.token_events = 0  # deltas forwarded: the estimate of a stream that ended without its usage

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward now: whole events only, none after the terminal event."""
        if self.saw_done:
            return b""
        tail = self._tail
        start = max(len(tail) - 2, 0)  # (a blank line split between two reads: see gateway.http.sse)
        tail += data
        end = last_event_end(tail, start)
        if end < 0:
            return b""
        complete = bytes(tail[:end])
        del tail[:end]
        return self._forward(complete)

    def flush(self) -> bytes:
        """What to forward of a last event the engine did not end with its blank line: its terminal event,
        ended; anything else is dropped, as an SSE client drops an event cut short."""
        rest, self._tail = bytes(self._tail).strip(), bytearray()
        if not rest or _READ.search(rest) is None:
            return b""
        return self._forward(rest + b"\n\n")

    def _forward(self, complete: bytes) -> bytes:
        if _READ.search(complete) is None:
            self.token_events += len(_DELTA.findall(complete))
            return complete
        out = []
        for event in split_events(complete):
            kept = self._read(event)
            if kept:
                out.append(kept)
                self.token_events += len(_DELTA.findall(kept))
            if self.saw_done:
                break  # (what an engine sends after the end is neither forwarded nor billed)
        return b"".join(out)

    def _read(self, event: bytes) -> bytes:
        """The event to forward, noting what it says."""
        if _READ.search(event) is None or count_events(event) == 0:
            return event
        payload = data_of(event)
        try:
            message = orjson.loads(payload) if payload is not None else None
        except orjson.JSONDecodeError:
            return event
        if not isinstance(message, dict):
            return event
        kind = message.get("type")
        if kind == "error" or (kind is None and isinstance(message.get("error"), dict)):
            self.error = message.get("error") if kind is None else message
            return event
        response = message.get("response")
        if not isinstance(response, dict):
            return event
        if self.response_id is None and isinstance(response.get("id"), str):
            self.response_id = response["id"]
            if self._on_response is not None:
                self._on_response(response)
        if kind not in TERMINAL:
            return event
        self.saw_done = True
        if kind == "response.failed":
            error = response.get("error")
            self.error = error if isinstance(error, dict) else {"message": "the response failed"}
        usage = response.get("usage")
        if not isinstance(usage, dict):
            return event
        self.usage = self.final_usage = usage
        extras = self._annotate(usage) if self._annotate is not None else None
        if not extras:
            return event
        message["response"] = {**response, "usage": {**usage, **extras}}
        return b"event: " + str(kind).encode() + b"\ndata: " + orjson.dumps(message) + b"\n\n"
