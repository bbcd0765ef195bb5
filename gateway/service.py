"""The request path: parse, tokenize, hash, route, proxy, account.

Nothing here waits on Redis (see ``shared_state``); the only awaits before the request leaves are reading
the body and, for a session id never seen before, one Redis read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
import xxhash
from aiohttp import web

from cache.hashing import PrefixHashMemo, namespace_seed
from cache.sessions import SessionBinding
from cache.tokens import ChatContentError, Tokenizer, render_chat
from gateway.config import KvgateConfig
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    PayloadTooLarge,
    UpstreamFailed,
    UpstreamTimedOut,
)
from gateway.metrics import GatewayMetrics
from gateway.routing import Candidate, RouteDecision, RouteRequest, RoutingPolicy
from gateway.schemas import ChatCompletionRequest, CompletionRequest, parse_chat, parse_completion
from gateway.shared_state import SharedState
from gateway.sse import SseUsageTap
from gateway.upstream import (
    Response,
    UpstreamClients,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from region_map.fleet import EngineState, Fleet

log = logging.getLogger("kvgate.gateway")

DEFAULT_TENANT = "default"
SESSION_HEADER = "x-session-affinity"
MAX_ATTEMPTS = 3  # engines tried for one request while nothing has been sent to the client


@dataclass(slots=True)
class Prepared:
    """A validated request, tokenized and hashed: everything routing needs."""

    request_id: str
    tenant: str
    session_id: str | None
    model: str
    path: str
    body: dict[str, Any]
    stream: bool
    client_wants_usage: bool
    token_ids: np.ndarray
    hashes: list[int]
    cache_salt: str


class Gateway:
    def __init__(
        self,
        config: KvgateConfig,
        *,
        fleet: Fleet,
        state: SharedState,
        clients: UpstreamClients,
        metrics: GatewayMetrics,
        tokenizer: Tokenizer,
        policy: RoutingPolicy,
    ) -> None:
        self.config = config
        self.settings = config.gateway
        self.fleet = fleet
        self.state = state
        self.clients = clients
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.policy = policy
        self.started = int(time.time())
        self._seq = 0
        self._seeds: dict[tuple[str, str], int] = {}
        self._hasher = PrefixHashMemo()  # conversations resend their prefix: hash it once

    # -- endpoints -------------------------------------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = await self._read_json(request)
        parsed = parse_chat(body)
        return await self._serve(request, received, self._prepare_chat(request, body, parsed))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        received = time.perf_counter()
        body = await self._read_json(request)
        parsed = parse_completion(body)
        return await self._serve(request, received, self._prepare_completion(request, body, parsed))

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "created": self.started, "owned_by": "kvgate"}
            for m in self.fleet.models()
        ]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        engines = [e.describe() for e in self.fleet]
        healthy = sum(1 for e in self.fleet if e.healthy)
        body = {
            "status": "ok" if healthy else "no_healthy_engine",
            "gateway_id": self.state.gateway_id,
            "region": self.fleet.region,
            "redis": "off" if self.state.redis is None else "on",
            "engines_healthy": healthy,
            "engines_total": len(self.fleet),
            "engines": engines,
        }
        return _json(body, status=200 if healthy else 503)

    # -- preparing -------------------------------------------------------------------------------------

    async def _read_json(self, request: web.Request) -> Any:
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise PayloadTooLarge(
                f"request body of {request.content_length} bytes exceeds the {limit}-byte limit"
            )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise PayloadTooLarge(f"request body exceeds the {limit}-byte limit") from None
        if not raw:
            raise InvalidRequest("request body is empty; send a JSON object")
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None

    def _common(
        self, request: web.Request, body: dict[str, Any], parsed: ChatCompletionRequest | CompletionRequest
    ) -> tuple[str, str | None, str]:
        if not self.fleet.serving(parsed.model):
            raise ModelNotFound(f"The model '{parsed.model}' does not exist", param="model")
        request_id = _request_id(request.headers.get("x-request-id"))
        session_id = self._session_id(request.headers.get(SESSION_HEADER))
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(max_tokens, int) and max_tokens > self.settings.max_output_tokens:
            raise InvalidRequest(
                f"max_tokens is {max_tokens}; this gateway allows at most {self.settings.max_output_tokens}",
                param="max_tokens",
            )
        return request_id, session_id, parsed.model

    def _session_id(self, raw: str | None) -> str | None:
        if raw is None:
            return None
        limit = self.settings.max_session_id_length
        if not raw or len(raw) > limit or not all("!" <= ch <= "~" for ch in raw):
            raise InvalidRequest(
                f"{SESSION_HEADER} must be 1 to {limit} visible ASCII characters (no spaces)",
                param=SESSION_HEADER,
                code="invalid_header",
            )
        return raw

    def _prepare_chat(
        self, request: web.Request, body: dict[str, Any], parsed: ChatCompletionRequest
    ) -> Prepared:
        request_id, session_id, model = self._common(request, body, parsed)
        try:
            text = render_chat(body["messages"])
        except ChatContentError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        return self._finish_prepare(
            request_id, session_id, model, "/v1/chat/completions", body, parsed, self.tokenizer.encode(text)
        )

    def _prepare_completion(
        self, request: web.Request, body: dict[str, Any], parsed: CompletionRequest
    ) -> Prepared:
        request_id, session_id, model = self._common(request, body, parsed)
        prompt: Any = parsed.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest("only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        tokens = (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt, dtype=np.uint32)
        )
        return self._finish_prepare(request_id, session_id, model, "/v1/completions", body, parsed, tokens)

    def _finish_prepare(
        self,
        request_id: str,
        session_id: str | None,
        model: str,
        path: str,
        body: dict[str, Any],
        parsed: ChatCompletionRequest | CompletionRequest,
        token_ids: np.ndarray,
    ) -> Prepared:
        if len(token_ids) > self.settings.max_prompt_tokens:
            raise InvalidRequest(
                f"the prompt has {len(token_ids)} tokens; "
                f"this gateway allows at most {self.settings.max_prompt_tokens}",
                param="messages" if path.endswith("chat/completions") else "prompt",
                code="context_length_exceeded",
            )
        tenant = DEFAULT_TENANT
        cache_salt = parsed.cache_salt or ""
        seed_key = (model, cache_salt)
        seed = self._seeds.get(seed_key)
        if seed is None:
            seed = self._seeds[seed_key] = namespace_seed(model, cache_salt)
        stream = bool(parsed.stream)
        wants_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return Prepared(
            request_id=request_id,
            tenant=tenant,
            session_id=session_id,
            model=model,
            path=path,
            body=body,
            stream=stream,
            client_wants_usage=wants_usage,
            token_ids=token_ids,
            hashes=self._hasher.block_hashes(token_ids, self.settings.block_size, seed),
            cache_salt=cache_salt,
        )

    # -- routing ---------------------------------------------------------------------------------------

    def _candidates(self, engines: list[EngineState], cached: dict[str, int]) -> list[Candidate]:
        block_size = self.settings.block_size
        out = []
        for e in engines:
            total, waiting = e.queue_estimate()
            precise = e.block_size in (None, block_size)
            out.append(
                Candidate(
                    engine=e.id,
                    region=e.region,
                    healthy=e.healthy,
                    load=total,
                    waiting=waiting,
                    cached_blocks=cached.get(e.id, 0) if precise else 0,
                    rtt_s=self.fleet.rtt_s(e.region),
                    queued_prefill_tokens=max(e.pending_prefill_tokens, e.load.waiting_tokens),
                )
            )
        return out

    def _route_key(self, p: Prepared) -> int:
        if p.session_id is not None:
            return xxhash.xxh3_64_intdigest(f"{p.tenant}\x00{p.session_id}".encode())
        if p.hashes:
            return p.hashes[-1]
        return xxhash.xxh3_64_intdigest(p.token_ids.tobytes())

    async def _serve(self, request: web.Request, received: float, p: Prepared) -> web.StreamResponse:
        binding = await self.state.lookup_session(p.tenant, p.session_id) if p.session_id else None
        engines = self.fleet.serving(p.model)
        cached = self.state.lookup(p.hashes)
        self._seq += 1
        route = RouteRequest(
            prompt_tokens=len(p.token_ids),
            block_size=self.settings.block_size,
            route_key=self._route_key(p),
            seq=self._seq,
            session_engine=binding.engine if binding else None,
        )
        excluded: set[str] = set()
        last_error: GatewayError | None = None
        for attempt in range(MAX_ATTEMPTS):
            candidates = self._candidates([e for e in engines if e.id not in excluded], cached)
            decision = self.policy.pick(route, candidates)
            if decision is None:
                break
            engine = self.fleet.engines[decision.engine]
            if attempt:
                decision = RouteDecision(decision.engine, "failover", decision.cached_blocks)
            try:
                known_blocks = cached.get(engine.id, 0)
                return await self._dispatch(request, received, p, engine, decision, known_blocks)
            except _Retryable as exc:
                excluded.add(engine.id)
                last_error = exc.error
                log.warning(
                    "request %s: engine %s failed before answering: %s",
                    p.request_id,
                    engine.id,
                    exc.error.message,
                )
        if last_error is not None:
            raise last_error
        raise NoCapacity(
            f"no healthy engine serves model '{p.model}' right now", headers={"Retry-After": "1"}
        )

    # -- proxying --------------------------------------------------------------------------------------

    def _upstream_body(self, p: Prepared, engine: EngineState) -> bytes:
        body = dict(p.body)
        if engine.config.accepts_token_ids:
            body["prompt_token_ids"] = p.token_ids
            if p.cache_salt:
                body["cache_salt"] = p.cache_salt
        if p.stream:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)

    async def _dispatch(
        self,
        request: web.Request,
        received: float,
        p: Prepared,
        engine: EngineState,
        decision: RouteDecision,
        known_blocks: int,
    ) -> web.StreamResponse:
        block_size = self.settings.block_size
        predicted = min(decision.cached_blocks * block_size, len(p.token_ids))
        uncached = len(p.token_ids) - predicted
        pool = self.clients.pool(engine.url)
        payload = self._upstream_body(p, engine)
        headers = [("Content-Type", "application/json"), ("X-Request-Id", p.request_id)]
        engine.inflight += 1
        engine.pending_prefill_tokens += uncached
        prefill_pending = True
        try:
            self.metrics.overhead.observe(time.perf_counter() - received)
            try:
                upstream = await pool.request(
                    "POST", p.path, payload, headers, header_timeout=self.settings.read_timeout_s
                )
            except UpstreamError as exc:
                self.metrics.upstream_error(engine.id, type(exc).__name__)
                if isinstance(exc, UpstreamConnectError):
                    # Refused or unreachable: stop routing there until its health check answers again.
                    engine.mark_failure(str(exc), unhealthy_after=1)
                raise _Retryable(UpstreamFailed(f"engine {engine.id} failed: {exc}")) from None
            self._after_dispatch(p, engine, decision, predicted, known_blocks)
            response_headers = {
                "x-request-id": p.request_id,
                "x-kvgate-region": engine.region,
                "x-kvgate-engine": engine.id,
                "x-kvgate-route": decision.reason,
                "x-kvgate-predicted-cached-tokens": str(predicted),
            }
            if upstream.status != 200 or not p.stream:
                engine.pending_prefill_tokens -= uncached
                prefill_pending = False
                return await self._relay_whole(p, engine, upstream, response_headers, received)
            engine.pending_prefill_tokens -= uncached
            prefill_pending = False
            return await self._relay_stream(request, p, engine, upstream, response_headers, received)
        finally:
            engine.inflight -= 1
            if prefill_pending:
                engine.pending_prefill_tokens -= uncached

    def _after_dispatch(
        self, p: Prepared, engine: EngineState, decision: RouteDecision, predicted: int, known_blocks: int
    ) -> None:
        """The engine accepted the request: bind the session, remember where the prefix went."""
        if p.session_id is not None:
            current = self.state.sessions.get_now(p.tenant, p.session_id)
            if current is None or current.engine != engine.id:
                self.state.bind_session(p.tenant, p.session_id, SessionBinding(engine.region, engine.id))
        s = self.settings
        if engine.kv_events:
            # Its events will report these blocks; until then, note the ones the view does not know of.
            self.state.record_route(engine.id, p.hashes[known_blocks:], s.pending_ttl_s, share=False)
        else:
            self.state.record_route(engine.id, p.hashes, s.approx_ttl_s, share=True)
        self.metrics.routed(engine.region, engine.id, decision.reason, predicted)

    async def _relay_whole(
        self, p: Prepared, engine: EngineState, upstream: Response, headers: dict[str, str], received: float
    ) -> web.Response:
        try:
            data = await upstream.read(self.settings.read_timeout_s)
        except UpstreamTimeout:
            self.metrics.upstream_error(engine.id, "timeout")
            raise UpstreamTimedOut(f"engine {engine.id} did not finish in time") from None
        except UpstreamError as exc:
            self.metrics.upstream_error(engine.id, type(exc).__name__)
            raise UpstreamFailed(f"engine {engine.id} broke off the response: {exc}") from None
        except asyncio.CancelledError:
            upstream.abort()  # the client went away: stop the engine's work too
            raise
        if upstream.status != 200:
            return self._engine_error(engine, upstream.status, data, headers)
        try:
            usage = orjson.loads(data).get("usage")
        except (orjson.JSONDecodeError, AttributeError):
            usage = None
        self._account(p, engine, usage if isinstance(usage, dict) else None, received, first_byte=None)
        return web.Response(body=data, status=200, content_type="application/json", headers=headers)

    async def _relay_stream(
        self,
        request: web.Request,
        p: Prepared,
        engine: EngineState,
        upstream: Response,
        headers: dict[str, str],
        received: float,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        tap = SseUsageTap(forward_usage_event=p.client_wants_usage)
        first_byte: float | None = None
        try:
            await response.prepare(request)
            while (data := await upstream.next_batch(self.settings.read_timeout_s)) is not None:
                if first_byte is None:
                    first_byte = time.perf_counter()
                out = tap.feed(data)
                if out:
                    await response.write(out)
            rest = tap.flush()
            if rest:
                await response.write(rest)
            await response.write_eof()
        except UpstreamError as exc:
            # Bytes already reached the client: end the stream with an error event, never retry.
            self.metrics.upstream_error(engine.id, type(exc).__name__)
            error = UpstreamFailed(f"engine {engine.id} broke off the stream: {exc}")
            await _try_write(response, b"data: " + orjson.dumps(error.body()) + b"\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            upstream.abort()  # the client went away: stop the engine's work too
            self._account(p, engine, tap.usage, received, first_byte)
            raise
        self._account(p, engine, tap.usage, received, first_byte)
        return response

    def _engine_error(
        self, engine: EngineState, status: int, data: bytes, headers: dict[str, str]
    ) -> web.Response:
        """An engine's own error: its 4xx pass through (they are about the request); a 5xx becomes a 502."""
        try:
            body = orjson.loads(data)
            message = body["error"]["message"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            body, message = None, data[:200].decode("utf-8", errors="replace") or f"HTTP {status}"
        if 400 <= status < 500 and isinstance(body, dict):
            return web.Response(body=data, status=status, content_type="application/json", headers=headers)
        self.metrics.upstream_error(engine.id, f"http_{status}")
        error = UpstreamFailed(f"engine {engine.id} answered {status}: {message}")
        if 400 <= status < 500:
            error.status = status
            error.type = "invalid_request_error"
        response = error.response()
        response.headers.update(headers)
        return response

    def _account(
        self,
        p: Prepared,
        engine: EngineState,
        usage: dict[str, Any] | None,
        received: float,
        first_byte: float | None,
    ) -> None:
        now = time.perf_counter()
        prompt = cached = completion = 0
        if usage is not None:
            prompt = _count(usage.get("prompt_tokens"))
            details = usage.get("prompt_tokens_details")
            cached = min(_count(details.get("cached_tokens")), prompt) if isinstance(details, dict) else 0
            completion = _count(usage.get("completion_tokens"))
        self.metrics.finished(
            engine.region,
            engine.id,
            p.model,
            latency_s=now - received,
            ttft_s=None if first_byte is None else first_byte - received,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
        )


class _Retryable(Exception):
    def __init__(self, error: GatewayError) -> None:
        super().__init__(error.message)
        self.error = error


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _request_id(raw: str | None) -> str:
    if raw and len(raw) <= 128 and all("!" <= ch <= "~" for ch in raw):
        return raw
    return "req-" + os.urandom(12).hex()


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


async def _try_write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
        await response.write_eof()
    except (ConnectionResetError, RuntimeError):
        pass
