"""Reading a client's request body: its size limit, content coding and JSON, before any schema."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import orjson
from multidict import MultiMapping

from gateway.http.content_coding import decode_body
from gateway.http.errors import InvalidRequest, PayloadTooLarge

THREAD_DECODE_BYTES = 64 << 10  # compressed bodies this large inflate to megabytes: off the event loop
MAX_NESTING = 254  # levels of arrays and objects orjson writes (it reads 1024); engine bodies are written


class ClientRequest(Protocol):
    """What the gateway reads of a client's request: an aiohttp request, or gateway.http.lean_http's."""

    @property
    def headers(self) -> MultiMapping[str]: ...

    @property
    def remote(self) -> str | None: ...

    @property
    def content_length(self) -> int | None: ...

    async def read(self) -> bytes: ...


async def read_json(request: ClientRequest, limit: int) -> Any:
    """The request's body as JSON: within ``limit`` bytes (decoded), an object or any JSON value (the
    caller's schema says what it needs), nested no deeper than engines' bodies can be written."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit"
        )
    raw = await request.read()  # (gateway.http.lean_http refuses a body past the limit as it comes)
    coding = request.headers.get("Content-Encoding")
    if coding is not None:
        if len(raw) < THREAD_DECODE_BYTES:
            raw = decode_body(raw, coding, limit)
        else:  # (zlib inflates without the GIL: a large body does not hold up the other requests)
            raw = await asyncio.get_running_loop().run_in_executor(None, decode_body, raw, coding, limit)
    if not raw:
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    # A body nested deeper than orjson writes was read, and failed (a 500) only when its engine's body
    # was written. Nesting that deep needs as many brackets: most bodies are cleared by counting them.
    if raw.count(b"[") + raw.count(b"{") > MAX_NESTING and not _writable(body):
        raise InvalidRequest(
            f"request body is nested too deeply (at most {MAX_NESTING} levels of arrays and objects)"
        )
    return body


def _writable(body: Any) -> bool:
    """Whether orjson writes ``body`` back; what it read, it refuses only for nesting past MAX_NESTING."""
    try:
        orjson.dumps(body)
    except TypeError:  # (orjson.JSONEncodeError)
        return False
    return True
