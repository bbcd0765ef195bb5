"""Relaying an engine's SSE stream: pass events through untouched, but catch the usage on the way.

The gateway always asks engines for ``stream_options.include_usage`` (billing needs the engine's
``cached_tokens``) and drops the usage-only event again when the client did not ask for it. Events are
only split and parsed when a batch mentions ``"usage"``; everything else is forwarded as received. The usage
the client sees may gain fields (its cost) through ``annotate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

# The usage an engine reported -> fields to add to the usage the client receives.
Annotate = Callable[[dict[str, Any]], dict[str, Any]]


class SseUsageTap:
    def __init__(self, *, forward_usage_event: bool, annotate: Annotate | None = None) -> None:
        self._forward_usage_event = forward_usage_event
        self._annotate = annotate
        self._tail = b""
        self.usage: dict[str, Any] | None = None  # the latest usage seen
        # Whether ``usage`` came in the usage-only chunk (``choices: []``) that ends the stream: the whole
        # request's. Before it a chunk may carry the usage so far (vLLM's ``continuous_usage_stats``, which
        # a client may ask for): billing from one of those would bill a few tokens of a long answer.
        self.usage_final = False
        self.saw_done = False
        self.events = 0  # data events forwarded
        self._wordless = 0  # of those, the chat role announcement and [DONE]: no completion token in them

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward now: whole events only (a partial event waits for its end)."""
        buf = self._tail + data if self._tail else data
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        if lf < 0 and crlf < 0:
            self._tail = buf
            return b""
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        complete, self._tail = buf[:end], buf[end:]
        if not self.events:
            self._wordless += _announces_role_only(complete)
        if b"[DONE]" in complete:
            self.saw_done = True
            self._wordless += 1
        if b'"usage"' not in complete:
            self.events += complete.count(b"data:")
            return complete
        out = b"".join(filter(None, map(self._rewrite, _split_events(complete))))
        self.events += out.count(b"data:")
        return out

    @property
    def token_events(self) -> int:
        """Forwarded events that carry a completion token (about one each): what a stream that ended before
        the engine's usage is billed for."""
        return max(self.events - self._wordless, 0)

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an engine that did not end its last event)."""
        rest, self._tail = self._tail, b""
        return rest

    def _rewrite(self, event: bytes) -> bytes | None:
        """The event to forward (None: drop it), noting the usage it carries."""
        if b'"usage"' not in event:
            return event
        payload = _data_of(event)
        if payload is None:
            return event
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(chunk, dict):
            return event
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return event
        self.usage = usage
        self.usage_final = not chunk.get("choices")
        if self.usage_final and not self._forward_usage_event:
            return None
        extras = self._annotate(usage) if self._annotate is not None else None
        if not extras:
            return event
        chunk["usage"] = {**usage, **extras}
        return b"data: " + orjson.dumps(chunk) + (b"\r\n\r\n" if event.endswith(b"\r\n\r\n") else b"\n\n")


def _announces_role_only(data: bytes) -> bool:
    """Whether the first event of ``data`` is a chat stream's opening chunk: the role, empty content."""
    ends = [i for i in (data.find(b"\n\n"), data.find(b"\r\n\r\n")) if i >= 0]
    first = data[: min(ends)] if ends else data
    return b'"role"' in first and (b'"content":""' in first or b'"content"' not in first)


def _split_events(data: bytes) -> list[bytes]:
    """Events with their terminating blank line, for either line ending."""
    sep = b"\r\n\r\n" if b"\r\n\r\n" in data else b"\n\n"
    parts = data.split(sep)
    return [p + sep for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _data_of(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
