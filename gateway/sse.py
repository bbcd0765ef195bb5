"""Relaying an engine's SSE stream: pass events through untouched, but catch the usage on the way.

The gateway always asks engines for ``stream_options.include_usage`` (billing needs the engine's
``cached_tokens``) and drops the usage-only event again when the client did not ask for it. Events are
only split and parsed when a batch mentions ``"usage"``; everything else is forwarded as received.
"""

from __future__ import annotations

from typing import Any

import orjson


class SseUsageTap:
    def __init__(self, *, forward_usage_event: bool) -> None:
        self._forward_usage_event = forward_usage_event
        self._tail = b""
        self.usage: dict[str, Any] | None = None
        self.saw_done = False

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward now: whole events only (a partial event waits for its end)."""
        buf = self._tail + data if self._tail else data
        lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
        if lf < 0 and crlf < 0:
            self._tail = buf
            return b""
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        complete, self._tail = buf[:end], buf[end:]
        if b"[DONE]" in complete:
            self.saw_done = True
        if b'"usage"' not in complete:
            return complete
        return b"".join(e for e in _split_events(complete) if self._keep(e))

    def flush(self) -> bytes:
        """Whatever is left when the stream ends (an engine that did not end its last event)."""
        rest, self._tail = self._tail, b""
        return rest

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        payload = _data_of(event)
        if payload is None:
            return True
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return True
        if not isinstance(chunk, dict):
            return True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
            if not chunk.get("choices"):
                return self._forward_usage_event
        return True


def _split_events(data: bytes) -> list[bytes]:
    """Events with their terminating blank line, for either line ending."""
    sep = b"\r\n\r\n" if b"\r\n\r\n" in data else b"\n\n"
    parts = data.split(sep)
    return [p + sep for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])


def _data_of(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
