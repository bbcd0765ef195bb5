"""Carrying an engine's answer back to the client, whole or as a stream of SSE events.

Each relay reports how the request ended exactly once through ``Accounting.done`` (also when the client
left mid-stream), so that whatever accounts for the request never counts it twice or not at all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol, cast

import orjson
from aiohttp import web

from gateway.errors import UpstreamFailed, UpstreamTimedOut
from gateway.lean_http import LeanRequest
from gateway.metrics import GatewayMetrics
from gateway.prepare import ClientRequest
from gateway.sse import SseUsageTap
from gateway.upstream import Response, UpstreamError, UpstreamTimeout

# completed: the whole answer reached the client; aborted: the client left after tokens streamed;
# failed: the engine broke off a stream that had started.
Outcome = Literal["completed", "aborted", "failed"]


class Accounting(Protocol):
    def annotate(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Fields to add to the usage the client receives (its cost)."""
        ...

    def done(
        self, usage: dict[str, Any] | None, first_byte: float | None, outcome: Outcome, events: int
    ) -> None:
        """Called once per relayed answer: the engine's usage (None if it never came), the perf_counter
        of the first streamed byte, how it ended, and how many SSE data events were forwarded."""
        ...


async def relay_whole(
    upstream: Response,
    *,
    engine_id: str,
    headers: dict[str, str],
    read_timeout_s: float,
    metrics: GatewayMetrics,
    accounting: Accounting,
) -> web.Response:
    try:
        data = await upstream.read(read_timeout_s)
    except UpstreamTimeout:
        metrics.upstream_error(engine_id, "timeout")
        raise UpstreamTimedOut(f"engine {engine_id} did not finish in time") from None
    except UpstreamError as exc:
        metrics.upstream_error(engine_id, type(exc).__name__)
        raise UpstreamFailed(f"engine {engine_id} broke off the response: {exc}") from None
    except asyncio.CancelledError:
        upstream.abort()  # the client went away: stop the engine's work too
        raise
    if upstream.status != 200:
        return engine_error(engine_id, upstream.status, data, headers, metrics)
    try:
        answer = orjson.loads(data)
        usage = answer.get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        usage = None
    extras = accounting.annotate(usage) if isinstance(usage, dict) else None
    if extras:
        answer["usage"] = {**usage, **extras}
        data = orjson.dumps(answer)
    accounting.done(usage if isinstance(usage, dict) else None, None, "completed", 0)
    return web.Response(body=data, status=200, content_type="application/json", headers=headers)


async def relay_stream(
    request: ClientRequest,
    upstream: Response,
    *,
    engine_id: str,
    headers: dict[str, str],
    forward_usage_event: bool,
    read_timeout_s: float,
    metrics: GatewayMetrics,
    accounting: Accounting,
    on_first_byte: Callable[[], None] | None = None,
) -> web.StreamResponse:
    # On gateway.lean_http's connections the stream is written there; else it is aiohttp's.
    response = (
        request.stream_response(headers)
        if isinstance(request, LeanRequest)
        else web.StreamResponse(status=200, headers=headers)
    )
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    tap = SseUsageTap(forward_usage_event=forward_usage_event, annotate=accounting.annotate)
    first_byte: float | None = None
    try:
        await response.prepare(cast(web.Request, request))
        while (data := await upstream.next_batch(read_timeout_s)) is not None:
            if first_byte is None:
                first_byte = time.perf_counter()
                if on_first_byte is not None:
                    on_first_byte()
            out = tap.feed(data)
            if out:
                await response.write(out)
        rest = tap.flush()
        if rest:
            await response.write(rest)
        await response.write_eof()
    except UpstreamError as exc:
        # Bytes already reached the client: end the stream with an error event, never retry.
        metrics.upstream_error(engine_id, type(exc).__name__)
        error = UpstreamFailed(f"engine {engine_id} broke off the stream: {exc}")
        await _try_write(response, b"data: " + orjson.dumps(error.body()) + b"\n\n")
        accounting.done(tap.usage, first_byte, "failed", tap.events)
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        upstream.abort()  # the client went away: stop the engine's work too
        accounting.done(tap.usage, first_byte, "aborted", tap.events)
        raise
    accounting.done(tap.usage, first_byte, "completed", tap.events)
    return response


def error_fields(data: bytes, status: int) -> tuple[bool, str | None, str]:
    """(is OpenAI-shaped, code, message) of an engine's error body; any other body gives its first 200
    characters (or the status) as the message."""
    try:
        error = orjson.loads(data)["error"]
        return True, error.get("code"), str(error["message"])
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return False, None, data[:200].decode("utf-8", errors="replace") or f"HTTP {status}"


def engine_error(
    engine_id: str, status: int, data: bytes, headers: dict[str, str], metrics: GatewayMetrics
) -> web.Response:
    """An engine's own error: its 4xx pass through (they are about the request); a 5xx becomes a 502."""
    openai_shaped, _, message = error_fields(data, status)
    if 400 <= status < 500 and openai_shaped:
        return web.Response(body=data, status=status, content_type="application/json", headers=headers)
    metrics.upstream_error(engine_id, f"http_{status}")
    error = UpstreamFailed(f"engine {engine_id} answered {status}: {message}")
    if 400 <= status < 500:
        error.status = status
        error.type = "invalid_request_error"
    response = error.response()
    response.headers.update(headers)
    return response


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass
