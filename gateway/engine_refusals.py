"""An engine's refusal before any byte reached the client, read into a ``Retryable``: the engine failed
the request (a 5xx, a broken K/V transfer) or is too busy for it (a 429, a 503 with ``Retry-After``), and
another engine may take it. What the client is told should no engine take it is ``Retryable.answer``."""

from __future__ import annotations

from typing import NoReturn

from gateway.http.errors import GatewayError, Overloaded, UpstreamFailed
from gateway.http.relay import MAX_ERROR_BODY, error_fields, upstream_error_kind
from gateway.http.retry_after import retry_after_headers, retry_after_seconds
from gateway.http.upstream_errors import UpstreamError
from gateway.http.upstream_response import Response
from gateway.observability.metrics import GatewayMetrics
from region_map.fleet import EngineState

# An engine too busy for a request named no wait (a 429 without Retry-After): another may have room by then.
BUSY_RETRY_AFTER_S = 1


class Retryable(Exception):
    """The engine failed before answering anything: another engine may take the request."""

    def __init__(
        self,
        error: GatewayError,
        who: str,
        *,
        prefill_failed: bool = False,
        busy_s: float | None = None,
    ) -> None:
        super().__init__(error.message)
        self.error = error
        self.who = who
        self.prefill_failed = prefill_failed  # the decode engine is fine; its K/V transfer broke
        self.busy_s = busy_s  # too busy: the wait before the gateway tries the engine again

    def answer(self, soonest_busy_s: float) -> GatewayError:
        """The error the client gets when this was the request's last attempt; a busy engine's says when
        the soonest of the busy engines the request met takes requests again (``Retry-After``)."""
        if self.busy_s is None:
            return self.error
        return self.error.with_headers(retry_after_headers(soonest_busy_s))


async def raise_refusal(
    upstream: Response,
    engine: EngineState,
    prefill: EngineState | None,
    metrics: GatewayMetrics,
    read_timeout_s: float,
) -> NoReturn:
    """Raise ``Retryable`` for an engine's answer that refuses the request: a 429 or any 5xx."""
    if prefill is not None and upstream.status == 502:
        await _raise_if_transfer_failed(upstream, engine, prefill, metrics, read_timeout_s)
    if upstream.status == 429 or (upstream.status == 503 and upstream.header(b"retry-after")):
        await _raise_busy(upstream, engine, metrics, read_timeout_s)
    await _raise_server_error(upstream, engine, metrics, read_timeout_s)


async def _raise_if_transfer_failed(
    upstream: Response,
    engine: EngineState,
    prefill: EngineState,
    metrics: GatewayMetrics,
    read_timeout_s: float,
) -> NoReturn:
    """A decode engine whose K/V transfer broke answers 502 before any token: retry elsewhere."""
    data = await upstream.read_at_most(MAX_ERROR_BODY, read_timeout_s)
    _, code, message = error_fields(data, upstream.status)
    metrics.upstream_error(
        prefill.id if code == "kv_transfer_failed" else engine.id, upstream_error_kind(502, code)
    )
    error_out = UpstreamFailed(f"engine {engine.id} answered 502: {message}")
    raise Retryable(error_out, prefill.id if code == "kv_transfer_failed" else engine.id,
                     prefill_failed=code == "kv_transfer_failed")  # fmt: skip


async def _raise_busy(
    upstream: Response, engine: EngineState, metrics: GatewayMetrics, read_timeout_s: float
) -> NoReturn:
    """An engine too busy for the request (a 429, or a 503 with ``Retry-After``; a 503 without one is
    any 5xx) before any byte reached the client: another engine may take it. A 429 was relayed to the
    client before, although other engines had room (and the session was bound there, the prompt recorded
    as cached there), and a ``Retry-After`` was ignored: the engine kept getting requests it refused.
    Now it gets none for as long as it asked; a 429 without ``Retry-After`` counts as a failure, as a
    5xx does. Should no engine take the request, the client gets 503 with a ``Retry-After`` rather than
    a 502 or the engine's 429 (the limit is not the client's)."""
    retry_after_s = retry_after_seconds(upstream.header(b"retry-after"))
    message = await _refusal_message(upstream, engine, metrics, read_timeout_s)
    if retry_after_s is None:
        engine.breaker.on_failure()
    else:
        engine.breaker.hold(retry_after_s)
    # The client is told the wait the gateway itself holds the engine out for: the engine's exactly (6.5
    # s: Retry-After 7, retry-after-ms 6500) up to the breaker's longest hold (a day asked for is 60 s:
    # the gateway routes there again by then); when it named none, the gateway's default. With several
    # engines busy, the soonest of them (``Retryable.answer``).
    if retry_after_s is None:
        busy_s = float(BUSY_RETRY_AFTER_S)
    else:
        busy_s = min(retry_after_s, engine.breaker.max_cooldown_s)
    error = Overloaded(f"engine {engine.id} is too busy ({upstream.status}: {message}); retry shortly")
    raise Retryable(error, engine.id, busy_s=busy_s)


async def _refusal_message(
    upstream: Response, engine: EngineState, metrics: GatewayMetrics, read_timeout_s: float
) -> str:
    """What an engine that refused the request (a 5xx, a 429) said, its body read for at most 5 s;
    counted as an upstream error of its status."""
    try:
        data = await upstream.read_at_most(MAX_ERROR_BODY, min(read_timeout_s, 5.0))
    except UpstreamError:
        data = b""
    metrics.upstream_error(engine.id, upstream_error_kind(upstream.status))
    return error_fields(data, upstream.status)[2]


async def _raise_server_error(
    upstream: Response, engine: EngineState, metrics: GatewayMetrics, read_timeout_s: float
) -> NoReturn:
    """An engine's 5xx before any byte reached the client: count it against the engine, try another."""
    message = await _refusal_message(upstream, engine, metrics, read_timeout_s)
    engine.breaker.on_failure()
    raise Retryable(UpstreamFailed(f"engine {engine.id} answered {upstream.status}: {message}"), engine.id)
