"""Failures a user can cause and fix: a busy port, Redis away, a refused key, a bad model path.

``kvgate`` says one in a single line (its message names the cause and the fix) and exits with ``status``;
the traceback is shown only with ``kvgate --debug``.
"""

from __future__ import annotations

import urllib.parse


class UserError(Exception):
    def __init__(self, message: str, *, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def without_credentials(url: str) -> str:
    """``url`` with no user or password in it, for messages and logs."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))
