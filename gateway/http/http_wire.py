"""The bytes of a whole HTTP/1.1 answer as the gateway writes it on a transport itself
(``gateway.http.lean_http``, and the refusals of ``gateway.http.edge``): status line, headers, framing, a
Date formatted once a second; and ``WholeAnswer``, the relayed whole answer that never becomes an aiohttp
Response."""

from __future__ import annotations

import time
from email.utils import formatdate
from typing import Any

import orjson
from aiohttp import web

Buffer = bytes | memoryview
LARGE_BODY_BYTES = 1 << 20  # a body this large is written after its head, not copied behind it


def json_response(body: Any, status: int = 200) -> web.Response:
    """A JSON answer the gateway makes itself (its models, health, usage)."""
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def whole_response(
    response: web.StreamResponse | WholeAnswer, keep_alive: bool, *, announce_keep_alive: bool = False
) -> bytes | list[Buffer]:
    """A whole answer's bytes as this server writes it: with a Content-Length, and ``Connection: close``
    unless the connection is kept alive (then, with ``announce_keep_alive``, as an HTTP/1.0 client must be
    told, ``Connection: keep-alive``). A large relayed answer comes as its parts, head first (see
    ``WholeAnswer.wire``)."""
    if isinstance(response, WholeAnswer):
        return response.wire(keep_alive, announce_keep_alive=announce_keep_alive)
    return response_bytes(response, keep_alive, announce_keep_alive=announce_keep_alive)


def response_bytes(
    response: web.StreamResponse, keep_alive: bool, *, announce_keep_alive: bool = False
) -> bytes:
    """An aiohttp answer's bytes, framed as ``whole_response`` frames it."""
    body = response.body if isinstance(response, web.Response) else None
    data = bytes(body) if isinstance(body, bytes | bytearray) else b""
    framing = [b"Content-Length: %d\r\n" % len(data)]
    if "Content-Type" not in response.headers:
        framing.append(b"Content-Type: application/octet-stream\r\n")
    framing.append(_connection_line(keep_alive, announce_keep_alive))
    return head(response, *framing) + data


def _connection_line(keep_alive: bool, announce: bool) -> bytes:
    if not keep_alive:
        return b"Connection: close\r\n"
    return b"Connection: keep-alive\r\n" if announce else b""


_SKIPPED = frozenset({"content-length", "transfer-encoding", "connection", "date"})  # this server's to set


def head(response: web.StreamResponse, *framing: bytes) -> bytes:
    """A response's status line and headers, with this server's framing lines, the Date and the blank line."""
    status = b"HTTP/1.1 %d %s\r\n" % (response.status, (response.reason or "").encode("latin-1"))
    headers = "".join(f"{k}: {v}\r\n" for k, v in response.headers.items() if k.lower() not in _SKIPPED)
    return b"".join((status, headers.encode("latin-1"), *framing, date_line(), b"\r\n"))


_date: tuple[int, bytes] = (0, b"")


def date_line() -> bytes:
    """The Date header, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, f"Date: {formatdate(now, usegmt=True)}\r\n".encode("ascii"))
    return _date[1]


class WholeAnswer:
    """A whole ``application/json`` answer relayed from an engine, kept as its bytes (or, rewritten at its
    end, as parts: views of the engine's bytes around a new piece) and a header dict: this server writes it
    as it is (``wire``). Making a ``web.Response`` of it (a CIMultiDict, the content type parsed back) and
    framing that cost about 4 us per request, as much as parsing and re-serializing the engine's answer."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes | list[Buffer], headers: dict[str, str], status: int = 200) -> None:
        self.body = body
        self.headers = headers  # the gateway's own (x-request-id, x-kvgate-*): none of the framing ones
        self.status = status

    def content(self) -> bytes:
        """The body as one bytes object (joined, when it is parts)."""
        body = self.body
        return body if isinstance(body, bytes) else b"".join(body)

    def wire(self, keep_alive: bool, *, announce_keep_alive: bool = False) -> bytes | list[Buffer]:
        """The answer's bytes, framed as ``whole_response`` frames any other: one bytes object, or for a
        large body, its head and then its body's parts (written as they are: a copy of 160 MB behind its
        head held the event loop for a tenth of a second)."""
        body = self.body
        length = len(body) if isinstance(body, bytes) else sum(len(part) for part in body)
        reason = _REASONS.get(self.status) or web.Response(status=self.status).reason
        fields = "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        head = (
            b"HTTP/1.1 %d %s\r\n" % (self.status, reason.encode("latin-1")),
            fields.encode("latin-1"),
            b"Content-Type: application/json\r\nContent-Length: %d\r\n" % length,
            _connection_line(keep_alive, announce_keep_alive),
            date_line(),
            b"\r\n",
        )
        if isinstance(body, bytes):
            if length < LARGE_BODY_BYTES:
                return b"".join((*head, body))
            return [b"".join(head), body]
        return [b"".join(head), *body]


_REASONS = {200: "OK"}

# What a handler of the gateway answers: a stream or an aiohttp Response (its status, headers and body are
# written here), or a relayed whole answer.
Answer = web.StreamResponse | WholeAnswer
