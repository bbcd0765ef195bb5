"""Logging: JSON lines (one object per record, with the record's structured fields) or plain text.

``kvgate --log-format auto`` (the default) writes JSON lines unless stderr is a terminal. The gateway's
access log (logger ``kvgate.access``) has one line per finished request with its request id, tenant,
region, engine, tokens, cached tokens, time to first token and cost; pass structured fields as
``log.info(msg, extra={"fields": {...}})``.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import sys
from typing import Any

from gateway import json_text

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Characters that would let text a client or an engine controls (a path, a model name, an x-request-id, an
# engine's error message) end the line and forge records of its own (CWE-117), move the cursor of a terminal
# (C0/C1 controls, DEL), make the stream's encoder refuse the record (lone surrogates: non-UTF-8 bytes),
# or reorder what a terminal or an editor shows of the rest of the line (the bidirectional controls of
# "Trojan Source", CVE-2021-42574: a model name holding U+202E shows the fields after it backwards).
# And the backslash itself: unescaped, a client's literal backslash-n would log as a newline it sent does,
# and a reader could not tell which it was.
_UNSAFE = re.compile(
    "[\\\\\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
_SHORT = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_UNSHORT = {escape[1]: char for char, escape in _SHORT.items()}
# An escape escape_controls writes: a backslash and a letter of _SHORT, \xHH or \uHHHH.
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|([\\nrt]))")


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _SHORT:
        return _SHORT[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x1b``), so it stays one line,
    and its backslashes doubled, so the escapes are the only ones: ``unescape_controls`` gives it back."""
    return _UNSAFE.sub(_escape, text)


def _unescape(match: re.Match[str]) -> str:
    hex2, hex4, short = match.groups()
    if short is not None:
        return _UNSHORT[short]
    return chr(int(hex2 or hex4, 16))


def unescape_controls(line: str) -> str:
    """The text ``escape_controls`` was given: ``unescape_controls(escape_controls(s)) == s`` for every
    string (lone surrogates included). A backslash that starts no escape it writes is kept as it is."""
    return _ESCAPE.sub(_unescape, line)


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
        # (json_text: a record quoting bytes a client sent that are not UTF-8 was dropped, with a traceback on
        # stderr, when orjson refused it)
        return json_text.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """Plain text, with the structured fields appended as key=value; one record is always one line.

    The message, the fields and a traceback have their control characters escaped (``\\n``, ``\\x1b``) and
    their backslashes doubled (``\\\\``): ``unescape_controls`` reads a line back exactly.
    """

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        # Escaped as a whole: a traceback's own newlines too, since its last line quotes the exception's
        # message, which may carry a client's text.
        return escape_controls(text)


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
