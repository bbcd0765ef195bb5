"""JSON of text that may hold lone surrogates: bytes a client sent that are not UTF-8 (a path's ``%FF``, a
header's value), decoded with ``surrogateescape``. orjson refuses such text; it is written backslash-escaped
(``\\udcff``) instead, so that an error answer or a log line is still written, and still one JSON line."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson


def dumps(value: Any, default: Callable[[Any], Any] | None = None) -> bytes:
    """``orjson.dumps``; for a value holding text it refuses, the same with that text escaped."""
    try:
        return orjson.dumps(value, default=default)
    except TypeError:  # (orjson.JSONEncodeError)
        return orjson.dumps(_escaped(value), default=default)


def _escaped(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_escaped(v) for v in value]
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")
