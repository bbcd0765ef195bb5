"""Where each stored Responses API response is: only the engine that answered a request keeps its response
(vLLM in memory, with ``VLLM_ENABLE_RESPONSES_API_STORE=1``; kvgate's engines too), so a request continuing it
(``previous_response_id``) and a request for it by id (``GET``/``DELETE /v1/responses/{id}``, ``POST
.../cancel``, ``GET .../input_items``) must go to that engine, and no other engine can stand in for it.

A response's id is bound to its engine as a session is (``SharedState.bind_session``: this gateway's view at
once, Redis for the others), under its tenant: another tenant's request never finds it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web

from cache.sessions import SessionBinding, response_key
from gateway.http.errors import InvalidRequest, NotFound, Unavailable
from gateway.http.lean_request import LeanRequest
from gateway.http.relay import answer_object, engine_error, read_answer
from gateway.http.retry_after import retry_after_headers
from gateway.http.trace_context import trace_headers
from gateway.http.upstream import UpstreamClients
from gateway.http.upstream_errors import UpstreamError
from gateway.observability.metrics import GatewayMetrics
from gateway.state.shared_state import SharedState
from region_map.fleet import EngineState, Fleet

MAX_RESPONSE_ID = 256
REDIS_AWAY_RETRY_AFTER_S = 1.0  # (the background writer probes Redis about once a second)
# (method, what follows the id) of the requests about a stored response: OpenAI's, and vLLM's cancel.
_ROUTES = frozenset({("GET", ""), ("DELETE", ""), ("POST", "cancel"), ("GET", "input_items")})


def not_found(response_id: str, param: str = "response_id") -> NotFound:
    """vLLM's own answer for an id it does not hold (its message, param and status)."""
    return NotFound(f"Response with id '{response_id[:MAX_RESPONSE_ID]}' not found.", param=param)


def nameable(response_id: str) -> bool:
    """Whether ``response_id`` could name a stored response: an engine's ids are short text. A longer one,
    or one a path's bytes decoded to lone surrogates (``%FF``), which neither the engine's URL nor a Redis
    key can encode (a 500 before), is nobody's: the 404 of any id nobody made, asked of nothing."""
    if len(response_id) > MAX_RESPONSE_ID:
        return False
    try:
        response_id.encode()
    except UnicodeEncodeError:
        return False
    return True


class StoredResponses:
    def __init__(
        self,
        state: SharedState,
        fleet: Fleet,
        clients: UpstreamClients,
        metrics: GatewayMetrics,
        read_timeout_s: float,
        *,
        tenants_apart: bool = False,
    ):
        self.state = state
        self.fleet = fleet
        self.clients = clients
        self.metrics = metrics
        self.read_timeout_s = read_timeout_s
        # With authentication on, an engine cannot tell tenants apart: only a binding says whose it is.
        self.tenants_apart = tenants_apart

    def bind(self, tenant: str, engine: EngineState, response: dict[str, Any]) -> asyncio.Future[Any] | None:
        """Note where ``response`` (as its engine first announced it) is kept, unless it is not kept.

        The id is new: it is claimed in Redis at once, not behind the writer's backlog, since the client may
        ask any gateway about it as soon as it has it. Returns the claim's answer (bounded by the Redis read
        timeout), which a whole answer waits for before it is sent; None when Redis is not written now."""
        response_id = response.get("id")
        if response.get("store") is False or not isinstance(response_id, str) or not response_id:
            return None
        key = response_key(response_id)
        binding = SessionBinding(engine.region, engine.id, time.time())
        self.state.bind_session(tenant, key, binding, claim=True)
        return self.state.claims.get((tenant, key))

    async def engine_of(self, tenant: str, response_id: str) -> EngineState | None:
        """The engine that holds ``response_id``, as far as any gateway knows (None: nobody knows it)."""
        binding = await self.state.lookup_session(tenant, response_key(response_id))
        if binding is None:
            return None
        return self.fleet.engines.get(binding.engine)

    async def continued(self, tenant: str, response_id: str, model: str) -> EngineState | None:
        """The engine a request for ``model`` continuing ``response_id`` (``previous_response_id``) must go
        to: InvalidRequest when it does not serve that model (no other engine can stand in). An id no
        gateway bound for ``tenant`` is NotFound when tenants are kept apart: on the engine that keeps it, it
        may be another tenant's conversation. Otherwise (one tenant: a binding expired, or made by a gateway
        that could not reach Redis) None: any engine may hold it, and one that does not answers 404."""
        engine = await self.engine_of(tenant, response_id)
        if engine is None and self.tenants_apart:
            raise self._unknown(response_id, "previous_response_id")
        if engine is not None and engine not in self.fleet.serving(model):
            raise InvalidRequest(
                f"response '{response_id}' is kept by engine {engine.id}, which does not serve model "
                f"'{model}': continue it with the model that made it, or send the conversation as input",
                param="previous_response_id",
            )
        return engine

    def _unknown(self, response_id: str, param: str) -> NotFound | Unavailable:
        """The answer for an id no gateway bound for the caller: NotFound, unless Redis, where the other
        gateways' bindings are, cannot be asked now (it may have been made through one of them)."""
        if self.state.redis is not None and self.state.writer.failing:
            return Unavailable(
                f"cannot tell where response '{response_id}' is kept while Redis is unreachable; "
                "retry shortly",
                headers=retry_after_headers(REDIS_AWAY_RETRY_AFTER_S),
            )
        return not_found(response_id, param)

    async def answer(self, request: LeanRequest, tenant: str, rid: str) -> web.Response:
        """The answer to ``request`` (an id in ``match_info["response"]``, maybe with an action) for a
        caller of ``tenant``: the engine's, or NotFound/Unavailable; ``rid`` names it to the engine."""
        response_id, _, action = request.match_info["response"].partition("/")
        # A HEAD is the GET's answer without its body (the lean server drops the body), as on every route
        # whose 405 says HEAD: the engine is asked with a GET.
        method = "GET" if request.method == "HEAD" else request.method
        if (method, action) not in _ROUTES:
            raise NotFound(f"no route for {request.method} /v1/responses/{response_id}/{action[:64]}")
        query = request.query
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise InvalidRequest(
                "streaming a stored response is not supported by this gateway", param="stream"
            )
        if not nameable(response_id):
            raise not_found(response_id)
        path = "/v1/responses/" + quote(response_id, safe="") + ("/" + action if action else "")
        if query:
            path += "?" + urlencode(list(query.items()))
        sent = [("X-Request-Id", rid), *trace_headers(request.headers)]
        return await self.forward(tenant, method, response_id, path, rid, sent)

    async def forward(
        self, tenant: str, method: str, response_id: str, path: str, rid: str, sent: list[tuple[str, str]]
    ) -> web.Response:
        """Send a request about a stored response to the engine holding it, and relay its answer: a 200's
        JSON object, or its error as an OpenAI error (``relay.engine_error``: a 5xx becomes a 502).
        NotFound for an id no gateway bound for this tenant, Unavailable when its engine cannot be asked,
        UpstreamFailed for a 200 that is no JSON object (a proxy's page). ``response_id`` is ``nameable``
        (``answer`` checked it before quoting it into ``path``). ``sent``: the headers the engine gets."""
        engine = await self.engine_of(tenant, response_id)
        if engine is None:
            raise self._unknown(response_id, "response_id")
        if not engine.healthy:
            raise Unavailable(f"engine {engine.id}, which holds response '{response_id}', is unavailable")
        pool = self.clients.pool(engine.url)
        headers = {"x-request-id": rid}
        try:
            upstream = await pool.request(method, path, b"", sent, header_timeout=self.read_timeout_s)
            data = await read_answer(upstream, self.read_timeout_s)
        except UpstreamError as exc:
            raise Unavailable(
                f"engine {engine.id}, which holds response '{response_id}', failed: {exc}"
            ) from None
        if upstream.status != 200:
            return engine_error(engine.id, upstream.status, data, headers, self.metrics)
        answer_object(engine.id, data, self.metrics)  # (relayed as the engine wrote it)
        return web.Response(body=data, content_type="application/json", headers=headers)
