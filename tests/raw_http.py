"""HTTP/1.1 responses parsed off a raw byte stream: what tests that speak to the gateway over a bare socket
read its answers with (partial requests, pipelining, slow clients)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httptools


@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


class Replies:
    """Responses parsed off a byte stream, in order (1xx interim responses included)."""

    def __init__(self) -> None:
        self.done: list[Reply] = []
        self._current = Reply()
        self._parser = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_begin(self) -> None:
        self._current = Reply()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self._current.status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        self.done.append(self._current)
