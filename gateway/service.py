"""The request path: prepare, route, dispatch, relay, account.

Nothing here waits on Redis (see ``shared_state``); the only awaits before the request leaves are reading
the body and, for a session id never seen before, one Redis read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from cache.tokens import Tokenizer
from gateway.config import KvgateConfig
from gateway.engine_refusals import Retryable, raise_refusal
from gateway.health_report import HealthReport
from gateway.http.engine_body import engine_body
from gateway.http.errors import (
    GatewayError,
    ModelNotFound,
    UpstreamFailed,
    UpstreamTimedOut,
)
from gateway.http.http_wire import Answer, json_response
from gateway.http.lean_request import LeanRequest
from gateway.http.pd_protocols import PrefillFailed, SglangPrefill, sglang_bootstrap, vllm_prefill
from gateway.http.relay import StreamClient, StreamTap, relay_stream, relay_whole
from gateway.http.responses_sse import ResponsesStreamTap
from gateway.http.sse import SseUsageTap
from gateway.http.upstream import UpstreamClients
from gateway.http.upstream_errors import UpstreamConnectError, UpstreamError
from gateway.http.upstream_response import Response
from gateway.observability.metrics import GatewayMetrics
from gateway.prepare import RequestPreparer
from gateway.prepared import Prepared
from gateway.prompt_batch import PromptBatch, serve_batch
from gateway.request_limits import RESPONSES_PATH
from gateway.routing import RoutingPolicy
from gateway.routing.route import Route
from gateway.routing.router import Router
from gateway.state.shared_state import SharedState
from gateway.stored_responses import StoredResponses
from gateway.tenancy.accounting import RequestAccount
from gateway.tenancy.answer_tokens import own_completion_count
from gateway.tenancy.billing import Billing, Caller
from gateway.tenancy.tenants import Tenant
from gateway.waits import Waits
from region_map.breaker import CircuitBreaker
from region_map.config import EngineKind, Role
from region_map.fleet import EngineState, Fleet

log = logging.getLogger("kvgate.gateway")


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
        billing: Billing,
    ) -> None:
        self.config = config
        self.settings = config.gateway
        self.fleet = fleet
        self.state = state
        self.clients = clients
        self.metrics = metrics
        self.policy = policy
        self.billing = billing
        self.prepare = RequestPreparer(config.gateway, fleet, tokenizer)
        self._own_count = functools.partial(own_completion_count, tokenizer)
        self.router = Router(config.gateway, fleet, state, policy, metrics=metrics)
        s = self.settings
        self.health_report = HealthReport(fleet, state, billing)
        self.waits = Waits(config.gateway)
        self.stored = StoredResponses(
            state, fleet, clients, metrics, s.read_timeout_s, tenants_apart=s.auth.enabled
        )
        self.resilience = r = config.gateway.resilience
        for engine in fleet:
            engine.down_quiet_s = r.unhealthy_silence_s
            engine.breaker = CircuitBreaker(
                failures=r.breaker_failures,
                cooldown_s=r.breaker_cooldown_s,
                max_cooldown_s=r.breaker_max_cooldown_s,
            )
        self.started = int(time.time())
        self.operator_url: str | None = (
            None  # the operator listener's, once it listens (gateway.observability.operator)
        )

    # -- endpoints -------------------------------------------------------------------------------------

    async def chat_completions(self, request: LeanRequest) -> Answer:
        return await self._complete(request, self.prepare.chat)

    async def completions(self, request: LeanRequest) -> Answer:
        return await self._complete(request, self.prepare.completion)

    async def responses(self, request: LeanRequest) -> Answer:
        """``POST /v1/responses``: the Responses API, routed and billed as a chat is."""
        return await self._complete(request, self.prepare.responses)

    async def embeddings(self, request: LeanRequest) -> Answer:
        """``POST /v1/embeddings``: routed by load and session, admitted and billed by its prompt tokens."""
        return await self._complete(request, self.prepare.embeddings)

    async def stored_response(self, request: LeanRequest) -> Answer:
        """``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel``, ``GET .../input_items``: asked of
        the engine that holds the response (``gateway.stored_responses``)."""
        caller = await self._caller(request)
        rid = self.prepare.refused_request_id(request)
        limits: dict[str, str] = {}
        try:
            # Each costs the engine a request: counted against the caller's limit, as a usage read is.
            limits = await self.billing.admit_request(caller) or {}
            answer = await self.stored.answer(request, caller.tenant.name, rid)
        except GatewayError as exc:
            exc.headers["x-request-id"] = rid
            for name, value in limits.items():
                exc.headers.setdefault(name, value)
            raise
        answer.headers.update(limits)
        return answer

    async def _complete(
        self,
        request: LeanRequest,
        prepare: Callable[[LeanRequest, Any, Tenant], Awaitable[Prepared | PromptBatch]],
    ) -> Answer:
        """Admit, prepare and serve a completion. Its errors name the request (``x-request-id``) as its
        answers do: the OpenAI SDKs read it into every error they raise, and clients quote it."""
        received = time.perf_counter()
        p: Prepared | PromptBatch | None = None
        limits: dict[str, str] | None = None  # OpenAI's x-ratelimit-* headers, for a caller with limits
        try:
            caller = await self._caller(request)
            limits = await self.billing.admit_request(caller)
            body = await self.prepare.read_json(request)
            p = await prepare(request, body, caller.tenant)
            if isinstance(p, PromptBatch):  # several prompts: a request each (gateway.prompt_batch)
                tokens = await self.billing.admit_tokens(caller, p.prompt_tokens, p.output_budget)
                if tokens is not None:
                    limits = tokens if limits is None else {**limits, **tokens}
                p.admitted(caller.key_id, limits)
                return await serve_batch(self._serve, request, received, p)
            p.key_id = caller.key_id
            if p.previous_response_id is not None:
                holder = await self.stored.continued(p.tenant, p.previous_response_id, p.model)
                p.pinned_engine = holder.id if holder is not None else None
            tokens = await self.billing.admit_tokens(caller, len(p.token_ids), p.output_budget)
            if tokens is not None:
                limits = tokens if limits is None else {**limits, **tokens}
            p.ratelimit_headers = limits
            return await self._serve(request, received, p)
        except GatewayError as exc:
            rid = p.request_id if p is not None else self.prepare.refused_request_id(request)
            exc.headers["x-request-id"] = rid
            if limits is not None:  # an answer after admission, refused or failed, says them as well
                for name, value in limits.items():
                    exc.headers.setdefault(name, value)
            raise

    async def _caller(self, request: LeanRequest) -> Caller:
        """Who sent the request, known before its body is read: gateway.http.lean_http checks the key once the
        headers are in and hands the verdict on (``caller``: the Caller, or its look-up still under way
        when the body came whole first); identified here when nobody did (authentication was off then)."""
        known = request.caller
        if known is None:
            return await self.billing.identify(request.headers.get("Authorization"))
        return known if isinstance(known, Caller) else await known

    async def models(self, request: LeanRequest) -> web.Response:
        return json_response({"object": "list", "data": [self._model_object(m) for m in self.fleet.models()]})

    async def model(self, request: LeanRequest) -> web.Response:
        """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``): one model, or 404."""
        model = request.match_info["model"]
        if not self.fleet.serving(model):
            raise ModelNotFound(f"The model '{model[:200]}' does not exist", param="model")
        return json_response(self._model_object(model))

    def _model_object(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": self.started, "owned_by": "kvgate"}

    async def health(self, request: LeanRequest) -> web.Response:
        return self.health_report.response(details=True)

    # -- serving -------------------------------------------------------------------------------------

    async def _serve(self, request: StreamClient, received: float, p: Prepared) -> Answer:
        """Route (``gateway.routing.router``), dispatch, and fail over while nothing reached the client."""
        self.router.find_session(p)
        plan = self.router.plan(p)
        last: Retryable | None = None  # the last attempt's failure
        soonest_busy_s = math.inf  # the shortest wait of the engines that said they were too busy
        attempts = self.resilience.max_attempts + len(plan.prefilling)
        for attempt in range(attempts):
            route = self.router.decide(plan)
            if not isinstance(route, GatewayError) and (claim := self.router.pending_claim(plan)):
                route = await self.router.follow_claim(plan, route, claim)  # (a session new to this view)
            if isinstance(route, GatewayError):  # no engine left: say why the last one failed, if one did
                raise last.answer(soonest_busy_s) if last is not None else route
            try:
                return await self._dispatch(request, received, p, route)
            except Retryable as exc:
                self.router.failed(plan, route, prefill_only=exc.prefill_failed)
                log.warning("request %s: %s failed before answering: %s", p.request_id, exc.who, exc)
                last = exc
                if exc.busy_s is not None:
                    soonest_busy_s = min(soonest_busy_s, exc.busy_s)
                if attempt + 1 < attempts:  # (after the last attempt the client gets the error at once)
                    await asyncio.sleep(self.waits.backoff_s(attempt))
        assert last is not None  # (max_attempts is at least 1)
        raise last.answer(soonest_busy_s)

    # -- dispatch --------------------------------------------------------------------------------------

    async def _handoff(
        self,
        p: Prepared,
        engine: EngineState,
        prefill: EngineState | None,
        pull: _Pull | None,
        queue_wait_s: float,
    ) -> tuple[dict[str, Any] | None, SglangPrefill | None]:
        """What the answering engine's body gains from P/D or a pull, per kind; a vLLM prefill runs here,
        an SGLang one starts here (raises Retryable when the prefill fails). ``queue_wait_s``: the prompt's
        estimated wait in the prefill engine's queue, which its answer may take on top of its limit."""
        if pull is not None:
            return {"kv_transfer_params": {"pull_url": pull.source.url, "pull_engine": pull.source.id,
                                           "pull_tokens": pull.tokens}}, None  # fmt: skip
        if prefill is None:
            return None, None
        if prefill.kind is EngineKind.KVGATE:
            return {"kv_transfer_params": {"prefill_url": prefill.url, "prefill_engine": prefill.id}}, None
        timeout = self.waits.header_timeout_s(p) + queue_wait_s
        body = engine_body(p, prefill, default_block_size=self.settings.block_size)
        try:
            if prefill.kind is EngineKind.VLLM:
                # Its half is one whole token: a silent prefill engine gets one token's allowance (after the
                # prompt's wait in its queue), not the whole answer's (which can be minutes), before the
                # request fails over.
                r = self.resilience
                one_token = r.first_byte_timeout_s + r.s_per_output_token + queue_wait_s
                pool = self.clients.pool(prefill.url)
                params = await vllm_prefill(pool, p.path, body, p.engine_headers, one_token)
                return {"kv_transfer_params": params}, None
            bootstrap = sglang_bootstrap(prefill.url, prefill.config.bootstrap_port)
            body.update(bootstrap)
            return bootstrap, SglangPrefill(
                self.clients.pool(prefill.url), p.path, body, p.engine_headers, timeout
            )
        except PrefillFailed as exc:
            raise self._prefill_failed(prefill, exc) from None

    def _prefill_failed(self, prefill: EngineState, exc: PrefillFailed) -> Retryable:
        prefill.breaker.on_failure()
        self.metrics.upstream_error(prefill.id, "prefill_failed")
        return Retryable(UpstreamFailed(f"prefill engine {prefill.id} failed: {exc}"), prefill.id,
                          prefill_failed=True)  # fmt: skip

    async def _dispatch(self, request: StreamClient, received: float, p: Prepared, route: Route) -> Answer:
        engine, decision, prefill, predicted = route.engine, route.decision, route.prefill, route.predicted
        pull = None
        if route.pulled_tokens:
            assert decision.kv_source is not None
            pull = _Pull(self.fleet.engines[decision.kv_source], route.pulled_tokens)
        computing = route.computing
        account = RequestAccount(
            p,
            engine,
            billing=self.billing,
            metrics=self.metrics,
            access_log=self.settings.access_log,
            received=received,
            predicted=predicted,
            settle=route.settle,
        )
        exchanges: list[Response] = []  # (two when a stale pooled connection is retried)
        engine.inflight += 1
        sent_mark = engine.report_lag.sent()
        engine.breaker.on_dispatch()
        sglang_prefill: SglangPrefill | None = None
        try:
            self.metrics.overhead.observe(time.perf_counter() - received)
            account.dispatched()
            queue_wait_s = self.waits.queue_wait_s(route)
            try:
                additions: dict[str, Any] | None = None
                if pull is not None or prefill is not None:
                    additions, sglang_prefill = await self._handoff(p, engine, prefill, pull, queue_wait_s)
                body = engine_body(
                    p, engine, default_block_size=self.settings.block_size, additions=additions
                )
                sent = self.clients.pool(engine.url).request(
                    "POST",
                    p.path,
                    orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
                    p.engine_headers,
                    header_timeout=self.waits.header_timeout_s(p) + queue_wait_s,
                    started=lambda response: _track(engine, response, exchanges),
                )
                upstream = await (sglang_prefill.race(sent) if sglang_prefill is not None else sent)
            except PrefillFailed as exc:
                assert prefill is not None
                raise self._prefill_failed(prefill, exc) from None
            except UpstreamError as exc:
                self.metrics.upstream_error(engine.id, type(exc).__name__)
                engine.breaker.on_failure()
                if isinstance(exc, UpstreamConnectError):
                    # Refused or unreachable: stop routing there until its health check answers again.
                    engine.mark_failure(str(exc), unhealthy_after=1)
                raise Retryable(UpstreamFailed(f"engine {engine.id} failed: {exc}"), engine.id) from None
            except asyncio.CancelledError:
                account.done(None, None, "aborted", 0)  # the client left; the engine had taken the prompt
                raise
            if upstream.status >= 500 or upstream.status == 429:
                await raise_refusal(upstream, engine, prefill, self.metrics, self.settings.read_timeout_s)
            engine.breaker.on_success()
            self.router.confirm(route, p, computed=upstream.status == 200)
            sglang_prefill = None  # (it finishes by itself now: the decode engine has answered)
            headers = {
                "x-request-id": p.request_id,
                "x-kvgate-region": engine.region,
                "x-kvgate-engine": engine.id,
                "x-kvgate-route": decision.reason,
                "x-kvgate-predicted-cached-tokens": str(predicted),
                "x-kvgate-home-region": p.home_region,
            }
            if p.ratelimit_headers is not None:
                headers.update(p.ratelimit_headers)
            if pull is not None:
                headers["x-kvgate-kv-pull-from"] = pull.source.id
                self.metrics.kv_pulled(engine.region, pull.tokens)
            if prefill is not None or engine.role is not Role.BOTH:
                path = "remote" if prefill is not None else "local"
                headers["x-kvgate-prefill"] = path
                headers["x-kvgate-prefill-engine"] = computing.id
                headers["x-kvgate-decode-engine"] = engine.id
                self.metrics.disaggregated(engine.region, path, computing.id, engine.id)
            timeout = self.settings.read_timeout_s
            # A Responses API answer: its id is bound to the engine that keeps it, as soon as it is known.
            responses = p.path == RESPONSES_PATH
            bind = functools.partial(self.stored.bind, p.tenant, engine) if responses else None
            try:
                if upstream.status != 200 or not p.stream:
                    return await relay_whole(
                        upstream,
                        engine_id=engine.id,
                        headers=headers,
                        read_timeout_s=timeout,
                        metrics=self.metrics,
                        accounting=account,
                        on_answer=bind,
                        own_count=self._own_count,
                    )
                tap: StreamTap = (
                    ResponsesStreamTap(annotate=account.annotate, on_response=bind)
                    if responses
                    else SseUsageTap(forward_usage_event=p.client_wants_usage, annotate=account.annotate)
                )
                return await relay_stream(
                    request,
                    upstream,
                    engine_id=engine.id,
                    headers=headers,
                    tap=tap,
                    read_timeout_s=timeout,
                    stall_timeout_s=self.resilience.stall_timeout_s,
                    metrics=self.metrics,
                    accounting=account,
                    on_first_byte=route.settle,  # the prefill is done once tokens flow
                )
            except (UpstreamFailed, UpstreamTimedOut) as exc:
                # It broke off before anything reached the client: another engine may answer.
                engine.breaker.on_failure()
                raise Retryable(exc, engine.id) from None
        finally:
            if sglang_prefill is not None:
                sglang_prefill.cancel()
            engine.inflight -= 1
            engine.report_lag.request_ended(sent_mark, p.prompt_tokens - predicted)
            engine.breaker.on_abandon()
            route.settle()
            engine.exchanges.difference_update(exchanges)
            account.void()  # (nothing, when the answer was accounted for)


def _track(engine: EngineState, response: Response, exchanges: list[Response]) -> None:
    """Note an exchange with ``engine``, to be failed at once if the engine is declared unhealthy."""
    exchanges.append(response)
    engine.exchanges.add(response)


@dataclass(frozen=True, slots=True)
class _Pull:
    """The prefix an engine is told to pull from a peer of its region (``kv_transfer_params.pull_url``)."""

    source: EngineState
    tokens: int  # leading prompt tokens the peer holds, as the residency view knows it
