"""A large whole answer's ``usage``, read and rewritten at its end without parsing the rest.

An embeddings answer of 2048 inputs at 4096 dimensions is about 160 MB of JSON: parsing it whole to read its
usage, and writing it out again to add the cost, held the event loop for about a second (orjson holds the
GIL, so a worker thread would not free the loop). OpenAI's and vLLM's answers end with their ``usage``
member; an answer whose last member is an object named ``usage`` has it read and replaced there. Anything
else (usage elsewhere, or text that only looks so) is parsed whole, as every smaller answer is.
"""

from __future__ import annotations

from typing import Any

import orjson

# Below this, parsing the whole answer costs less than a millisecond or so: not worth a second path.
TAIL_USAGE_BYTES = 1 << 20
_KEY = b'"usage"'
_SPACE = b" \t\r\n"


class TailUsage:
    """The usage object that ends a JSON object (``body[start:end]``), and that object parsed."""

    __slots__ = ("body", "end", "start", "usage")

    def __init__(self, body: bytes, start: int, end: int, usage: dict[str, Any]) -> None:
        self.body, self.start, self.end, self.usage = body, start, end, usage

    def replaced(self, usage: dict[str, Any]) -> list[bytes | memoryview]:
        """The answer with ``usage`` in place of its own, as the parts to write one after the other: views of
        the engine's bytes around the new usage. Nothing of the body is copied (joined, a 160 MB answer took
        0.12 s of the event loop to copy)."""
        view = memoryview(self.body)  # (slices of a view are not copies)
        return [view[: self.start], orjson.dumps(usage), view[self.end :]]


def tail_usage(body: bytes) -> TailUsage | None:
    """The usage ending ``body`` when ``body`` is a JSON object whose last member is ``"usage": {...}``;
    None otherwise (the caller then parses the whole answer). Only the object's ends are checked: a body
    broken in the middle is relayed as the engine wrote it. Nothing of the body is copied but the usage."""
    first = _skip(body, 0, 1)
    if body[first : first + 1] != b"{":
        return None
    close = _skip(body, len(body) - 1, -1)  # the outer object's closing brace
    if close < 1 or body[close] != ord("}"):
        return None
    key = body.rfind(_KEY, 0, close)
    if key < 0 or body[_skip(body, key - 1, -1)] not in b",{":  # (a member of the outer object)
        return None
    colon = _skip(body, key + len(_KEY), 1)
    if body[colon : colon + 1] != b":":
        return None
    start, end = _skip(body, colon + 1, 1), _skip(body, close - 1, -1) + 1
    if body[start : start + 1] != b"{" or body[end - 1 : end] != b"}":
        return None
    try:
        usage = orjson.loads(body[start:end])
    except orjson.JSONDecodeError:
        return None  # (a "usage" key inside another member's value: more than one value follows it)
    return TailUsage(body, start, end, usage) if isinstance(usage, dict) else None


def _skip(body: bytes, at: int, step: int) -> int:
    """The first index from ``at`` on (``step`` 1) or back (``step`` -1) that holds no JSON whitespace."""
    while 0 <= at < len(body) and body[at] in _SPACE:
        at += step
    return at
