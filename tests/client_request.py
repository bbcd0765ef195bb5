"""What ``gateway.prepare`` reads of a client's request (``gateway.request_body.ClientRequest``): for tests
that prepare a body without sending it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BareRequest:
    headers: dict[str, str] = field(default_factory=dict)
    remote: str | None = "127.0.0.1"
    content_length: int | None = 2

    async def read(self) -> bytes:
        return b"{}"
