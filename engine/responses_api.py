"""The engine's Responses API routes, as vLLM 0.32 serves them (and ``DELETE`` and ``GET .../input_items``,
which OpenAI has and vLLM lacks): ``POST /v1/responses``, ``GET /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``, ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.
Responses are kept (``store``, true by default as OpenAI's) in a bounded LRU in memory; vLLM keeps them only
with VLLM_ENABLE_RESPONSES_API_STORE=1, and without a bound."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from engine.async_engine import EngineDead
from engine.kv_serve import REQUEST_ID_HEADER, engine_failed
from engine.openai_api import new_request_id
from engine.openai_choices import Choices
from engine.openai_errors import OpenAIError, json_response, read_body
from engine.openai_format import sse_response
from engine.responses_format import StreamedResponse, WholeResponse
from engine.responses_items import input_items, items_page
from engine.responses_request import ResponsesRequest, not_found, parse_responses_request
from engine.responses_store import DEFAULT_CAPACITY, ResponseStore, StoredResponse

if TYPE_CHECKING:
    from engine.engine_types import StepOutput
    from engine.server import EngineServer


class ResponsesApi:
    """The Responses routes of one engine server, and the responses it keeps."""

    def __init__(self, server: EngineServer, capacity: int = DEFAULT_CAPACITY) -> None:
        self._server = server
        self.store = ResponseStore(capacity)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_delete("/v1/responses/{response_id}", self.delete)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        app.router.add_get("/v1/responses/{response_id}/input_items", self.list_input_items)

    async def create(self, request: web.Request) -> web.StreamResponse:
        server = self._server
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            req = parse_responses_request(
                await read_body(request),
                served_model=server.model,
                tokenizer=server.tokenizer,
                history=self.store.get,
                request_id=request_id,
                max_model_len=server.info.max_model_len,
                vocab_size=server.info.vocab_size,
            )
            # An engine that keeps none says so in the response, as vLLM does without its store: a gateway
            # binds only the ids of responses said to be stored.
            req.store = req.store and self.store.capacity > 0
            outputs, first = await server.start(req.gen)
        except OpenAIError as exc:
            return exc.to_response(headers)
        headers.update(server.transfer_headers(req.gen, first))
        async with contextlib.aclosing(outputs):  # closing early (client gone) aborts the request
            if req.stream:
                return await self._stream(request, req, first, outputs, headers)
            return await self._whole(req, first, outputs, headers)

    async def _whole(
        self, req: ResponsesRequest, first: StepOutput, rest: Choices, headers: dict[str, str]
    ) -> web.Response:
        answer = WholeResponse(req, self._server.tokenizer)
        answer.add(first)
        try:
            async for _, out in rest:
                answer.add(out)
        except EngineDead as exc:
            return engine_failed(exc).to_response(headers)
        response = answer.response()
        self._keep(req, response)
        return json_response(orjson.dumps(response), headers=headers)

    async def _stream(
        self,
        request: web.Request,
        req: ResponsesRequest,
        first: StepOutput,
        rest: Choices,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = sse_response(headers)
        events = StreamedResponse(req, self._server.tokenizer)
        await response.prepare(request)
        try:
            await response.write(events.start() + events.add(first))
            async for _, out in rest:
                if chunk := events.add(out):
                    await response.write(chunk)
            finish = events.finish()
            assert events.response is not None
            self._keep(req, events.response)  # before the client hears it is done: it may continue at once
            await response.write(finish)
            await response.write_eof()
        except EngineDead as exc:
            error = engine_failed(exc)
            with contextlib.suppress(ConnectionResetError):
                await response.write(events.error(error.message, error.code))
        except ConnectionResetError:
            pass  # the client left; closing the iterator aborts the request
        return response

    def _keep(self, req: ResponsesRequest, response: dict[str, Any]) -> None:
        if req.store:  # (the items get their ids here, once: a listing shows the same ones every time)
            items = input_items(req.body["input"], req.previous)
            self.store.put(req.id, StoredResponse(response, req.messages, items))

    async def retrieve(self, request: web.Request) -> web.Response:
        """A stored response; ``?stream=true`` (vLLM's replay of a background response's events) has
        nothing to replay here, where every response ran in the foreground."""
        stored = self.store.get(request.match_info["response_id"])
        if stored is None:
            return not_found(request.match_info["response_id"]).to_response()
        if request.query.get("stream", "false").lower() not in ("false", "0"):
            message = "only background responses can be streamed again, and this engine runs none"
            return OpenAIError(message, param="stream").to_response()
        return json_response(orjson.dumps(stored.response))

    async def cancel(self, request: web.Request) -> web.Response:
        """As vLLM: only a background response can be cancelled, and every stored one here is finished."""
        response_id = request.match_info["response_id"]
        if self.store.get(response_id) is None:
            return not_found(response_id).to_response()
        return OpenAIError("Cannot cancel a synchronous response.", param="response_id").to_response()

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.store.delete(response_id):
            return not_found(response_id).to_response()
        return json_response(orjson.dumps({"id": response_id, "object": "response", "deleted": True}))

    async def list_input_items(self, request: web.Request) -> web.Response:
        """The items a stored response was generated from, a page at a time (OpenAI's route)."""
        response_id = request.match_info["response_id"]
        stored = self.store.get(response_id)
        if stored is None:
            return not_found(response_id).to_response()
        query = request.query
        try:
            page = items_page(
                stored.input_items,
                query,
                includes=query.getall("include[]", []) + query.getall("include", []),
            )
        except OpenAIError as exc:
            return exc.to_response()
        return json_response(orjson.dumps(page))
