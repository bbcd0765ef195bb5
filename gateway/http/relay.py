"""Carrying an engine's answer back to the client, whole or as a stream of SSE events.

Each relay reports how the request ended exactly once through ``Accounting.done`` (also when the client
left, mid-stream or before any byte), so that whatever accounts for the request never counts it twice or not
at all; except when the engine failed before anything reached the client: then the relay raises
``UpstreamFailed``/``UpstreamTimedOut`` and the caller may send the request to another engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Literal, Protocol, cast

import orjson
from aiohttp import web

from gateway.http.answer_usage import TAIL_USAGE_BYTES, tail_usage
from gateway.http.errors import GatewayError, UpstreamFailed, UpstreamTimedOut
from gateway.http.http_wire import WholeAnswer
from gateway.http.upstream_errors import UpstreamError, UpstreamTimeout
from gateway.http.upstream_response import Response
from gateway.observability.metrics import GatewayMetrics
from gateway.tenancy.billing import usage_is_credible

log = logging.getLogger("kvgate.gateway")

# completed: the whole answer reached the client; aborted: the client left after tokens streamed;
# failed: the engine broke off a stream that had started.
Outcome = Literal["completed", "aborted", "failed"]

# An engine's error body is read up to this many bytes (more, and the exchange is dropped), and its message
# relayed to the client and logged up to this many characters: a multi-megabyte error (an engine echoing a
# prompt, or a foreign server on its port) must not be copied into every answer and log line.
MAX_ERROR_BODY = 64 * 1024
MAX_ERROR_MESSAGE = 2048

# How long an engine has, after its [DONE], to end its HTTP response (a chunked body's terminator comes in
# a write of its own, often a few ms later): a response that ends in time leaves its keep-alive connection
# in the pool, where aborting at [DONE] made every streamed request open a new one. An engine that keeps its
# response open longer (a buggy one, a proxy holding the body's end) is in no known state: it is
# disconnected then. The client is not kept waiting for it: its stream ends at [DONE].
DONE_GRACE_S = 0.05


class Accounting(Protocol):
    def annotate(self, usage: dict[str, Any]) -> dict[str, Any]:
        """Fields to add to the usage the client receives (its cost)."""
        ...

    def usage_arrived(self, usage: dict[str, Any]) -> None:
        """A stream's final usage (its usage chunk) is in hand and about to be forwarded (its record can be
        made durable now). Called after every batch from then on, with the latest usage chunk's."""
        ...

    def streamed(self, tokens: int) -> None:
        """A stream has sent ``tokens`` completion tokens so far."""
        ...

    def done(
        self, usage: dict[str, Any] | None, first_byte: float | None, outcome: Outcome, streamed_tokens: int
    ) -> None:
        """Called once per relayed answer: the engine's usage (None if it never came), the perf_counter
        of the first streamed byte, how it ended, and the gateway's own count of its completion tokens (a
        stream's events; a whole answer's generated text when its usage cannot bill it): the estimate billed
        when the usage never came."""
        ...


# The gateway's own count of a whole answer's completion tokens, given the answer and its usage: None when
# the usage bills it (gateway.tenancy.answer_tokens).
OwnCount = Callable[[dict[str, Any], dict[str, Any] | None], Awaitable[int] | None]


class StreamClient(Protocol):
    """Whom a stream is relayed to: the client's request (``LeanRequest``), or a prompt's part of a batch's
    stream (``gateway.http.batch_stream``)."""

    def stream_response(self, headers: Mapping[str, str]) -> web.StreamResponse: ...


class StreamTap(Protocol):
    """What the relay reads of a stream as it passes: ``gateway.http.sse.SseUsageTap`` (completions), or
    ``gateway.http.responses_sse.ResponsesStreamTap`` (the Responses API)."""

    end_marker: str  # what ends a whole stream, in words: "[DONE]"
    usage: dict[str, Any] | None
    final_usage: dict[str, Any] | None
    error: dict[str, Any] | None
    saw_done: bool

    @property
    def token_events(self) -> int: ...

    def feed(self, data: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


async def relay_whole(
    upstream: Response,
    *,
    engine_id: str,
    headers: dict[str, str],
    read_timeout_s: float,
    metrics: GatewayMetrics,
    accounting: Accounting,
    on_answer: Callable[[dict[str, Any]], Awaitable[Any] | None] | None = None,
    own_count: OwnCount | None = None,
) -> WholeAnswer | web.Response:
    """Relay a whole answer (its usage annotated with the cost); an engine's error as ``engine_error``.
    An answer that breaks off, or a 200 that is no JSON object, raises ``UpstreamFailed`` or
    ``UpstreamTimedOut``: nothing reached the client, another engine may answer. ``on_answer`` sees a 200's
    answer before it is relayed; what it returns, if anything, is awaited before the answer goes out.
    ``own_count`` counts the completion tokens of an answer whose usage cannot bill it."""
    try:
        data = await read_answer(upstream, read_timeout_s)
    except UpstreamTimeout:
        metrics.upstream_error(engine_id, "timeout")
        raise UpstreamTimedOut(f"engine {engine_id} did not finish in time") from None
    except UpstreamError as exc:
        metrics.upstream_error(engine_id, type(exc).__name__)
        raise UpstreamFailed(f"engine {engine_id} broke off the response: {exc}") from None
    except asyncio.CancelledError:
        upstream.abort()  # the client went away: stop the engine's work too
        accounting.done(None, None, "aborted", 0)  # ... which took its prompt all the same
        raise
    if upstream.status != 200:
        return engine_error(engine_id, upstream.status, data, headers, metrics)
    tail = tail_usage(data) if len(data) > TAIL_USAGE_BYTES and on_answer is None else None
    if tail is not None and own_count is not None and not usage_is_credible(tail.usage):
        # A usage that cannot bill it: the answer is parsed whole below, so that its generated text is
        # counted (billed from the tail, a large answer's completion tokens were 0, however many it had).
        tail = None
    if tail is not None:  # (a large answer, embeddings above all: its usage read at its end)
        added = accounting.annotate(tail.usage)
        accounting.done(tail.usage, None, "completed", 0)
        return WholeAnswer(tail.replaced({**tail.usage, **added}) if added else data, headers)
    answer = answer_object(engine_id, data, metrics)
    noted = on_answer(answer) if on_answer is not None else None
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        usage = None
    extras = accounting.annotate(usage) if usage is not None else None
    if usage is not None and extras:
        answer["usage"] = {**usage, **extras}
        data = orjson.dumps(answer)
    counting = own_count(answer, usage) if own_count is not None else None
    accounting.done(usage, None, "completed", await counting if counting is not None else 0)
    if noted is not None:
        await asyncio.shield(noted)  # (shared: a client that leaves does not cancel it for others)
    return WholeAnswer(data, headers)


async def relay_stream(
    request: StreamClient,
    upstream: Response,
    *,
    engine_id: str,
    headers: dict[str, str],
    tap: StreamTap,
    read_timeout_s: float,
    stall_timeout_s: float,
    metrics: GatewayMetrics,
    accounting: Accounting,
    on_first_byte: Callable[[], None] | None = None,
) -> web.StreamResponse:
    """Relay an SSE stream. The client's response starts with the engine's first bytes: until then nothing
    has reached the client, and a failure raises ``UpstreamFailed``/``UpstreamTimedOut`` so that another
    engine may take the request. Once tokens flow, the engine may fall silent for ``stall_timeout_s`` at
    most; a stream that breaks off, or whose engine ends it without ``[DONE]`` (``tap.end_marker``), ends
    with an error event and is billed for what was sent."""
    page = _web_page_type(upstream)
    if page is not None:
        # A web page (a proxy's default site, the wrong service at the engine's URL) is no stream of tokens:
        # relayed, its first byte started the client's 200 and it was billed as a failed request. Nothing has
        # reached the client yet, so another engine may answer, as for a whole answer that is no JSON.
        metrics.upstream_error(engine_id, "malformed_answer")
        raise UpstreamFailed(f"engine {engine_id} answered the stream with a web page ({page})")
    response = request.stream_response(headers)  # written on the client's connection (gateway.http.lean_http)
    response.content_type = "text/event-stream"
    response.headers["Cache-Control"] = "no-cache"
    first_byte: float | None = None
    head_sent = False
    outcome: Outcome = "completed"
    timeout = read_timeout_s  # (a prompt may wait in the engine's queue; its health covers a dead engine)
    try:
        while (data := await upstream.next_batch(timeout)) is not None:
            if first_byte is None:
                first_byte = time.perf_counter()
                if on_first_byte is not None:
                    on_first_byte()
                await response.prepare(cast(web.Request, request))
                head_sent = True
                timeout = stall_timeout_s
            out = tap.feed(data)
            if tap.final_usage is not None:
                accounting.usage_arrived(tap.final_usage)  # billed before the last byte reaches the client
            else:
                accounting.streamed(tap.token_events)
            if out:
                await response.write(out)
            if tap.saw_done:
                # [DONE] ends the stream, whether or not the engine ends its response (a proxy holding the
                # chunked body's end, a buggy engine): the client is not kept waiting for the stall timeout.
                # The engine's connection is aborted unless its response ends within DONE_GRACE_S (a client
                # that leaves before, below, aborts it at once).
                upstream.abort_unless_ended_within(DONE_GRACE_S)
                break
        if first_byte is None:  # a 200 whose body ended empty: nothing reached the client, try another
            metrics.upstream_error(engine_id, "empty_stream")
            raise UpstreamFailed(f"engine {engine_id} ended its stream before sending anything")
        rest = tap.flush()
        if rest:
            await response.write(rest)
        if tap.error is not None:
            # The engine ended its stream with an error event (the SDK raises it): the stream failed, even
            # though its HTTP response ended cleanly.
            metrics.upstream_error(engine_id, "stream_error_event")
            outcome = "failed"
        elif not tap.saw_done:
            # The engine ended its response without [DONE] (a handler that returned mid-answer). The SDK ends
            # a stream quietly at EOF, so relayed as it is, a truncated answer would pass for a whole one:
            # end it with an error event, as a stream that breaks off is ended.
            metrics.upstream_error(engine_id, "stream_without_done")
            error = UpstreamFailed(f"engine {engine_id} ended the stream without {tap.end_marker}")
            await response.write(error.sse_event())
            outcome = "failed"
        await response.write_eof()
    except UpstreamError as exc:
        metrics.upstream_error(engine_id, type(exc).__name__)
        if first_byte is None:  # nothing reached the client: another engine may answer
            if isinstance(exc, UpstreamTimeout):
                raise UpstreamTimedOut(f"engine {engine_id} sent nothing within {timeout:g}s") from None
            raise UpstreamFailed(f"engine {engine_id} failed before its first token: {exc}") from None
        # Tokens already reached the client: end the stream with an error event, never retry.
        error = UpstreamFailed(f"engine {engine_id} broke off the stream: {exc}")
        await _try_write(response, error.sse_event())
        accounting.done(tap.usage, first_byte, "failed", tap.token_events)
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        upstream.abort()  # the client went away: stop the engine's work too
        accounting.done(tap.usage, first_byte, "aborted", tap.token_events)
        raise
    except Exception:
        if not head_sent:
            raise  # (nothing reached the client: the handler answers with a whole error)
        # A fault of the gateway's own once the stream began: a whole 500 now would be read inside the
        # started 200 as a chunk. It ends as a broken-off stream does, with the error as an event, and is
        # billed as failed for what it had.
        log.exception("internal error while relaying the stream of engine %s", engine_id)
        upstream.abort()
        await _try_write(
            response, GatewayError("internal error in the gateway; it has been logged").sse_event()
        )
        accounting.done(tap.usage, first_byte, "failed", tap.token_events)
        return response
    accounting.done(tap.usage, first_byte, outcome, tap.token_events)
    return response


WEB_PAGE_TYPES = (b"text/html", b"application/xhtml+xml")


def _web_page_type(upstream: Response) -> str | None:
    """The media type of an engine's 200 when it is a web page's, else None. Only pages are refused: engines
    written with aiohttp leave a stream's type at its default (application/octet-stream), or send none."""
    value = upstream.header(b"content-type")
    if value is None:
        return None
    media_type = value.split(b";", 1)[0].strip().lower()
    return media_type.decode("latin-1") if media_type in WEB_PAGE_TYPES else None


def answer_object(engine_id: str, data: bytes, metrics: GatewayMetrics) -> dict[str, Any]:
    """A 200's body, which must be a JSON object. One that is not (a proxy's error page, a body cut short)
    raises UpstreamFailed, counted as ``malformed_answer``: the SDK would fail parsing it with an error of its
    own, and nothing reached the client yet, so another engine may answer."""
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        metrics.upstream_error(engine_id, "malformed_answer")
        raise UpstreamFailed(f"engine {engine_id} answered 200 with a body that is no JSON object")
    return answer


def read_answer(upstream: Response, idle_timeout: float) -> Coroutine[Any, Any, bytes]:
    """A 200's whole body; an error's first ``MAX_ERROR_BODY`` (+1) bytes (``Response.read_at_most``).
    (Not a coroutine of its own: the caller awaits the read, with no extra layer on every answer.)"""
    if upstream.status == 200:
        return upstream.read(idle_timeout)
    return upstream.read_at_most(MAX_ERROR_BODY, idle_timeout)


def error_object(data: bytes) -> dict[str, Any] | None:
    """An engine's error body as OpenAI's error object: vLLM's ``{"error": {...}}``, or SGLang's flat
    ``{"object": "error", "message", "type", "param", "code"}``; None for any other body."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    error = body.get("error") if body.get("object") != "error" else body
    if not isinstance(error, dict) or "message" not in error:
        return None
    return error


def cut_message(message: str) -> str:
    """``message``, or its first ``MAX_ERROR_MESSAGE`` characters marked as cut."""
    if len(message) <= MAX_ERROR_MESSAGE:
        return message
    return f"{message[:MAX_ERROR_MESSAGE]}... [cut: {len(message)} characters]"


def error_fields(data: bytes, status: int) -> tuple[bool, str | None, str]:
    """(is OpenAI-shaped, code, message) of an engine's error body (read with ``read_at_most``), its message
    cut to ``MAX_ERROR_MESSAGE`` characters; any other body, or one over ``MAX_ERROR_BODY`` bytes, gives its
    first 200 characters (or the status) as the message."""
    if len(data) > MAX_ERROR_BODY:
        head = data[:200].decode("utf-8", errors="replace")
        return False, None, f"{head}... [cut: the body exceeds {MAX_ERROR_BODY} bytes]"
    error = error_object(data)
    if error is None:
        return False, None, data[:200].decode("utf-8", errors="replace") or f"HTTP {status}"
    code = error.get("code")
    return True, None if code is None else str(code)[:200], cut_message(str(error["message"]))


# The error codes an engine of ours answers a 502 with that the metrics tell apart; any other code (an engine,
# or whatever answers on its port, may send anything) counts as a plain http_502, so that the label set of
# kvgate_upstream_errors stays closed.
KNOWN_502_CODES = frozenset({"kv_transfer_failed"})


def upstream_error_kind(status: int, code: str | None = None) -> str:
    """The ``kind`` label of an engine's error answer: its status (a real 1xx-5xx, else ``http_other``) and,
    for a 502, its code when it is one of ``KNOWN_502_CODES``."""
    if not 100 <= status <= 599:
        return "http_other"
    if status == 502 and code in KNOWN_502_CODES:
        return f"http_502_{code}"
    return f"http_{status}"


def engine_error(
    engine_id: str, status: int, data: bytes, headers: dict[str, str], metrics: GatewayMetrics
) -> web.Response:
    """An engine's own error: its 4xx pass through (they are about the request), in OpenAI's nesting when
    the engine's is flat (SGLang); a 5xx becomes a 502."""
    error = error_object(data) if len(data) <= MAX_ERROR_BODY else None
    if 400 <= status < 500 and error is not None:
        message = str(error["message"])
        if error.get("object") == "error" or len(message) > MAX_ERROR_MESSAGE:
            # flat: what clients parse is {"error": {...}}; too long: cut, as every relayed message is
            fields = ("type", "param", "code")
            relayed = {"message": cut_message(message), **{k: error.get(k) for k in fields}}
            data = orjson.dumps({"error": relayed})
        return web.Response(body=data, status=status, content_type="application/json", headers=headers)
    _, _, message = error_fields(data, status)
    metrics.upstream_error(engine_id, upstream_error_kind(status))
    error_out = UpstreamFailed(f"engine {engine_id} answered {status}: {message}")
    if 400 <= status < 500:
        error_out.status = status
        error_out.type = "invalid_request_error"
    response = error_out.response()
    response.headers.update(headers)
    return response


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass
