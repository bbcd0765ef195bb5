"""Logging: JSON lines (one object per record, with the record's structured fields) or plain text.

``kvgate --log-format auto`` (the default) writes JSON lines unless stderr is a terminal. The gateway's
access log (logger ``kvgate.access``) has one line per finished request with its request id, tenant,
region, engine, tokens, cached tokens, time to first token and cost; pass structured fields as
``log.info(msg, extra={"fields": {...}})``.
"""

from __future__ import annotations

import datetime as dt
import logging
import sys
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        try:
            return orjson.dumps(entry, default=str).decode()
        except TypeError:
            # A str with a lone surrogate: bytes a client sent that are not UTF-8 (a path's ``%FF``, a
            # header's value, decoded with ``surrogateescape``). orjson refuses it, and logging would drop
            # the record with a traceback on stderr: written as ``\udcff`` instead, the line stays JSON.
            return orjson.dumps({k: _utf8(v) for k, v in entry.items()}, default=str).decode()


def _utf8(value: Any) -> Any:
    """``value``, or for one orjson cannot write, its text with lone surrogates backslash-escaped."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


class TextFormatter(logging.Formatter):
    """Plain text, with the structured fields appended as key=value."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return text


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
