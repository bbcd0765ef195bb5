"""The bytes of a whole HTTP/1.1 answer as the gateway writes it on a transport itself
(``gateway.http.lean_http``, and the refusals and timeouts of ``gateway.http.edge``): status line, headers,
framing, a Date formatted once a second."""

from __future__ import annotations

import time
from email.utils import formatdate

from aiohttp import web


def whole_response(response: web.StreamResponse, keep_alive: bool) -> bytes:
    """A whole answer's bytes as this server writes it: with a Content-Length, and ``Connection: close``
    unless the connection is kept alive."""
    body = response.body if isinstance(response, web.Response) else None
    data = bytes(body) if isinstance(body, bytes | bytearray) else b""
    framing = [b"Content-Length: %d\r\n" % len(data)]
    if "Content-Type" not in response.headers:
        framing.append(b"Content-Type: application/octet-stream\r\n")
    if not keep_alive:
        framing.append(b"Connection: close\r\n")
    return head(response, *framing) + data


_SKIPPED = frozenset({"content-length", "transfer-encoding", "connection", "date"})  # this server's to set


def head(response: web.StreamResponse, *framing: bytes) -> bytes:
    """A response's status line and headers, with this server's framing lines, the Date and the blank line."""
    status = b"HTTP/1.1 %d %s\r\n" % (response.status, (response.reason or "").encode("latin-1"))
    headers = "".join(f"{k}: {v}\r\n" for k, v in response.headers.items() if k.lower() not in _SKIPPED)
    return b"".join((status, headers.encode("latin-1"), *framing, _date_line(), b"\r\n"))


_date: tuple[int, bytes] = (0, b"")


def _date_line() -> bytes:
    """The Date header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode("ascii"))
    return _date[1]
