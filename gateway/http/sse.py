"""Relaying an engine's SSE stream: pass events through untouched, but catch the usage on the way.

The gateway always asks engines for ``stream_options.include_usage`` (billing needs the engine's
``cached_tokens``) and drops the usage-only event again when the client did not ask for it. Events are
only split and parsed when a batch mentions ``"usage"`` or ``"error"``; everything else is forwarded as
received. The usage the client sees may gain fields (its cost) through ``annotate``. An engine's error event
(``{"error": {...}}``, which vLLM and SGLang send when generation fails mid-stream) is forwarded and noted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

# The usage an engine reported -> fields to add to the usage the client receives.
Annotate = Callable[[dict[str, Any]], dict[str, Any]]

# The stream's end: a data line of its own ("[DONE]" inside a token's text is not one; a raw newline cannot
# be inside an event's JSON). Lines may end in \n, \r\n or a lone \r: SSE allows all three.
_DONE = re.compile(rb"(?:^|[\r\n])data: ?\[DONE\]")
# A blank line, which ends an event: two line ends, each \n, \r\n or a lone \r (a \r\n is one line end, not a
# \r and then an empty line).
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
# The same, searched for with bytes.find: two line ends in a row always hold one of these pairs ("\n\r\n" and
# "\r\n\r\n" hold "\n\r", "\r\n\n" holds "\n\n", "\r\r\n" holds "\r\r"); a "\n" right after a pair's \r is the
# rest of its \r\n, and of the blank line.
_PAIRS = (b"\n\n", b"\n\r", b"\r\r")
# A pair may be split between two reads, and a "\n\r" that ends a read waits for the next (last_event_end):
# the last two bytes of a buffered partial event are searched again with the next read.
_OVERLAP = 2
_USUAL_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
# A data field's line, at the start of a line ("data" alone is an empty data field). A "data:" inside a
# token's text is not one: it follows a quote or other JSON, never a line end (JSON has no raw newlines).
_DATA_LINE = re.compile(rb"(?:^|[\r\n])data(?:[:\r\n]|$)")


class SseUsageTap:
    """The relay's tap (``gateway.http.relay.StreamTap``) for a completion's stream."""

    end_marker = "[DONE]"

    def __init__(self, *, forward_usage_event: bool, annotate: Annotate | None = None) -> None:
        self._forward_usage_event = forward_usage_event
        self._annotate = annotate
        # A partial event waiting for its end. A bytearray: a large event (a huge token, an echoed prompt)
        # that arrives in many reads is appended to, not copied whole on each read.
        self._tail = bytearray()
        self.scanned = 0  # bytes searched for an event's end: about the stream's size, however it is read
        self.usage: dict[str, Any] | None = None  # the last usage seen, in any chunk
        # The usage of the usage chunk (``choices: []``), which comes after every token. Chunks with choices
        # may carry a running usage too (vLLM's ``continuous_usage_stats``): not the final count.
        self.final_usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None  # the engine's own error event, if it sent one
        self.saw_done = False
        self.events = 0  # SSE events with data forwarded (not data lines: an event may have several)
        self._wordless = 0  # of those, the chat role announcement, [DONE] and an error: no completion token

    def feed(self, data: bytes) -> bytes:
        """The bytes to forward now: whole events only (a partial event waits for its end), none after
        ``[DONE]``."""
        if self.saw_done:
            return b""
        tail = self._tail
        if tail:
            # The buffered bytes were searched already (they hold no event end): only the new ones are, and
            # the overlap an event end split between two reads needs. Searching all again on every read
            # would cost O(n^2) for an event of n bytes.
            start = max(len(tail) - _OVERLAP, 0)
            tail += data
            end = self._event_end(tail, start)
            if end < 0:
                return b""
            complete = bytes(tail[:end])
            del tail[:end]
        else:
            end = self._event_end(data, 0)
            if end < 0:
                tail += data
                return b""
            complete = data if end == len(data) else data[:end]
            tail += memoryview(data)[end:]
        if b"[DONE]" in complete and (done := _DONE.search(complete)) is not None:
            self.saw_done = True
            self._wordless += 1
            # [DONE] ends the stream: the SDK reads no further, its answer is whole. What an engine sends
            # after it is not forwarded, nor taken for a usage or an error that would bill the answer
            # otherwise than the client got it (in [DONE]'s read or later ones, which the relay never reads).
            complete = complete[: _first_event_end(complete, done.end())]
            tail.clear()
        if not self.events:
            self._wordless += _announces_role_only(complete)
        if b'"usage"' not in complete and b'"error"' not in complete:
            self.events += count_events(complete)
            return complete
        out = b"".join(filter(None, map(self._rewrite, split_events(complete))))
        self.events += count_events(out)
        return out

    def _event_end(self, buf: bytes | bytearray, start: int) -> int:
        """Where the last whole event of ``buf`` ends (-1: none), searching from ``start`` on."""
        self.scanned += len(buf) - start
        return last_event_end(buf, start)

    @property
    def token_events(self) -> int:
        """Forwarded events that carry a completion token (about one each): what a stream that ended before
        the engine's usage is billed for."""
        return max(self.events - self._wordless, 0)

    def flush(self) -> bytes:
        """What to forward, once the stream ended, of a last event the engine did not end with its blank
        line: a ``[DONE]`` is ended and forwarded; anything else is dropped, as an SSE client drops an event
        cut short (forwarded, half an event would run into the error event that the relay then writes)."""
        rest, self._tail = bytes(self._tail), bytearray()
        if not _DONE.fullmatch(rest.strip()):
            return b""
        self.saw_done = True
        self.events += 1
        self._wordless += 1
        return rest.strip() + b"\n\n"

    def _rewrite(self, event: bytes) -> bytes | None:
        """The event to forward (None: drop it), noting the usage or the error it carries."""
        if b'"usage"' not in event and b'"error"' not in event:
            return event
        payload = data_of(event)
        if payload is None:
            return event
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return event
        if not isinstance(chunk, dict):
            return event
        if isinstance(chunk.get("error"), dict) and not chunk.get("choices"):
            # The engine says its stream failed: the stream must not count as completed, and this event
            # carries no completion token.
            self.error = chunk["error"]
            self._wordless += 1
            return event
        usage = chunk.get("usage")
        if not isinstance(usage, dict):
            return event
        self.usage = usage
        if not chunk.get("choices"):
            self.final_usage = usage
            if not self._forward_usage_event:
                return None
        extras = self._annotate(usage) if self._annotate is not None else None
        if not extras:
            return event
        chunk["usage"] = {**usage, **extras}
        return b"data: " + orjson.dumps(chunk) + (b"\r\n\r\n" if event.endswith(b"\r\n\r\n") else b"\n\n")


def last_event_end(buf: bytes | bytearray, start: int) -> int:
    r"""Where the last blank line in ``buf[start:]`` ends, -1 if there is none. A "\n\r" that ends ``buf``
    waits for the next read: its \r most likely starts the \r\n whose \n ends the blank line (a lone \r after
    a \n would be an odd stream's; a stream of lone \r's has no \n and is not kept waiting)."""
    if buf.endswith(_USUAL_ENDS):  # the usual read: whole events, the last ended by a blank line of one style
        return len(buf)
    hi = len(buf) - 1 if buf.endswith(b"\n\r") else len(buf)
    i = buf.rfind(b"\n\n", start, hi)
    end = i + 2 if i >= 0 else -1
    if buf.find(b"\r", max(start, end - 1)) < 0:  # no \r after it (memchr): "\n\n" is the last blank line
        return end
    for pair in _PAIRS[1:]:
        i = buf.rfind(pair, max(start, end - 1), hi)  # only a pair that ends later can be the last
        if i >= 0:
            end = max(end, _pair_end(buf, i))
    return end


def _first_event_end(buf: bytes, start: int) -> int:
    """Where the first blank line in ``buf[start:]`` ends, -1 if there is none."""
    # The first line end, found with memchr, is where the pairs' search starts: a one-line event is found at
    # once, however large (an echoed prompt).
    lf, cr = buf.find(b"\n", start), buf.find(b"\r", start)
    if cr < 0:
        i = buf.find(b"\n\n", lf) if lf >= 0 else -1
        return i + 2 if i >= 0 else -1
    start = min(lf, cr) if lf >= 0 else cr
    end = -1
    for pair in _PAIRS:
        i = buf.find(pair, start, end if end >= 0 else len(buf))  # only a pair that ends earlier is first
        if i >= 0:
            end = _pair_end(buf, i)
    return end


def _pair_end(buf: bytes | bytearray, i: int) -> int:
    r"""The end of the blank line that holds the pair at ``i``: after the \n of a \r\n it ends in."""
    return i + 3 if buf[i + 1] == 0x0D and buf[i + 2 : i + 3] == b"\n" else i + 2


def _announces_role_only(data: bytes) -> bool:
    """Whether the first event of ``data`` is a chat stream's opening chunk: the role, empty content."""
    end = _first_event_end(data, 0)
    if end < 0:
        end = len(data)
    # Searched in place (a first event may be megabytes: an echoed prompt), not in a copy.
    if data.find(b'"role"', 0, end) < 0:
        return False
    return data.find(b'"content":""', 0, end) >= 0 or data.find(b'"content"', 0, end) < 0


def count_events(data: bytes) -> int:
    """The events in ``data`` (whole events) as an SSE client dispatches them: blocks ended by a blank line
    with at least one data line. Several data lines are one event; a comment (":...") or a block of other
    fields only (``event:``, ``id:``, ``retry:``) is none."""
    if b"\r" not in data and data.startswith(b"data:") and data.endswith(b"\n\n"):
        # The usual batch: events of one data line each, \n-ended. When every line end is half of a blank line
        # and every block starts with "data:", each block is one data line: a few C loops count the events,
        # with no split.
        blank = data.count(b"\n\n")
        if data.count(b"\n") == 2 * blank and data.count(b"\n\ndata:") == blank - 1:
            return blank
    return sum(1 for block in _BLANK_LINE.split(data) if _DATA_LINE.search(block))


def split_events(data: bytes) -> list[bytes]:
    """Events with their terminating blank line, for any of SSE's line endings, mixed within ``data`` too (a
    proxy's comments may end otherwise than the engine's events)."""
    if b"\r" not in data:  # \n only, the usual: a blank line is "\n\n"
        parts = data.split(b"\n\n")
        return [p + b"\n\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    events: list[bytes] = []
    start = 0
    for blank in _BLANK_LINE.finditer(data):
        events.append(data[start : blank.end()])
        start = blank.end()
    if start < len(data):
        events.append(data[start:])
    return events


def data_of(event: bytes) -> bytes | None:
    lines = [line[5:].lstrip(b" ") for line in event.splitlines() if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None
