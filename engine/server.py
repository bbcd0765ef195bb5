"""kvgate's engine over HTTP: the OpenAI API and KV events of the simulator, served by a real model.

Two ways to run the engine behind it: on a thread of this process (``AsyncEngine``: what
``EngineServer(LLMEngine, ...)`` does), or in an engine core process of its own (``engine.core``: give it an
``EngineCoreClient``), so that HTTP, tokenizing and detokenizing here overlap the model's steps there. The
core then serves the KV source routes itself, where the K/V cache is: these answer with a redirect to it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiohttp import web

from engine.async_engine import AsyncEngine, EngineDead
from engine.batch_serve import serve_batch
from engine.completion_batch import parse_requests
from engine.core.client import EngineCoreClient
from engine.core.messages import EngineInfo
from engine.embeddings_serve import EmbeddingsApi
from engine.engine_types import RequestRejected, StepOutput
from engine.kv_import import KvImporter
from engine.kv_publisher import KvEventPublisher
from engine.kv_serve import (
    MAX_BODY_BYTES,
    REQUEST_ID_HEADER,
    OpenFrames,
    end_stream_failed,
    engine_failed,
    serve_kv_source,
)
from engine.kv_transfer import KvTransferError
from engine.llm_engine import LLMEngine
from engine.metrics import EngineGauges, gpu_utilization, metrics_handler
from engine.openai_api import GenerationRequest, RequestKind, new_request_id
from engine.openai_choices import Choices, StreamAnswer, WholeAnswer
from engine.openai_errors import OpenAIError, json_response, openai_routing_errors, read_body
from engine.openai_format import model_object, models_body, sse_response
from engine.openai_sampling import FULL
from engine.responses_api import ResponsesApi
from engine.responses_store import DEFAULT_CAPACITY
from engine.sequence import CacheNamespace, SamplingParams

# remote: the prompt's K/V came from a prefill engine; pull: a pull from a peer's cache was asked for; local
TRANSFER_HEADER = "x-kvgate-kv-transfer"
TRANSFERRED_HEADER = "x-kvgate-kv-transferred-tokens"  # positions whose K/V arrived (0 after a failed pull)
ROLES = ("prefill", "decode", "both")
ENGINE_CORE_MODES = ("process", "thread")
EngineCoreMode = Literal["process", "thread"]
__all__ = ["MAX_BODY_BYTES", "REQUEST_ID_HEADER"]  # kept here for those that import them from the server


@dataclass(frozen=True)
class ServerConfig:
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0
    role: str = "both"
    responses_stored: int = DEFAULT_CAPACITY  # responses kept for the Responses API (0: none)


class EngineServer:
    """Serves an ``LLMEngine`` stepped on a thread here, or an engine core process (``EngineCoreClient``)."""

    def __init__(self, engine: LLMEngine | EngineCoreClient, config: ServerConfig) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {config.role!r}")
        self.config = config
        self.engine: AsyncEngine | EngineCoreClient
        self.importer: KvImporter | None = None
        if isinstance(engine, EngineCoreClient):
            self.llm: LLMEngine | None = None  # the model is in the core process
            self.info, self.tokenizer, self.counters = engine.info, engine.tokenizer, engine.counters
            self.publisher = KvEventPublisher(config.engine_id, self.info.block_size)
            engine.on_kv_events = self.publisher.publish
            self.engine = engine
        else:
            self.llm = engine
            self.info, self.tokenizer, self.counters = (
                EngineInfo.of(engine),
                engine.tokenizer,
                engine.counters,
            )
            self.publisher = KvEventPublisher(config.engine_id, self.info.block_size)
            # KV transfer needs the cache in this process: a tp/pp engine's lives in its workers.
            cache = engine.kv_cache
            self.importer = KvImporter(cache, engine.model_name) if cache is not None else None
            self.engine = AsyncEngine(engine, on_kv_events=self.publisher.publish, kv_fetcher=self.importer)
        self.created = int(time.time())

    @property
    def model(self) -> str:
        return self.info.model_name

    @property
    def failure(self) -> object | None:
        """Why the engine can compute nothing more (a dead worker rank), or None."""
        if isinstance(self.engine, EngineCoreClient):
            return self.engine.failure
        assert self.llm is not None
        return self.llm.failure

    async def lifespan(self, app: web.Application) -> AsyncIterator[None]:
        self.engine.start()
        yield
        await self.engine.stop()
        if self.importer is not None:
            await self.importer.close()

    # -- endpoints --------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def kv_prefill(self, request: web.Request) -> web.StreamResponse:
        """The prefill side of disaggregation: compute a prompt and stream its K/V, layer by layer."""
        engine = self.engine
        return await self._kv_source(request, engine.export if isinstance(engine, AsyncEngine) else None)

    async def kv_cached(self, request: web.Request) -> web.StreamResponse:
        """A peer's KV pull: stream the K/V that this engine's prefix cache holds of a prompt's positions
        ``from_position`` on, computing nothing and waiting behind no request; the done frame says how far
        it got. The blocks sent are evicted first from now on: the peer holds them."""
        engine = self.engine
        return await self._kv_source(
            request, engine.export_cached if isinstance(engine, AsyncEngine) else None
        )

    async def _kv_source(self, request: web.Request, open_frames: OpenFrames | None) -> web.StreamResponse:
        """Serve a KV source route here, or (``open_frames`` None: an engine core process holds the cache)
        redirect the request, body and all (307), to the core's own server of it."""
        if open_frames is not None:
            return await serve_kv_source(
                request,
                open_frames,
                model=self.model,
                block_size=self.info.block_size,
                max_model_len=self.info.max_model_len,
            )
        port = self.info.kv_port
        if port is None or not self.engine.alive:
            error = EngineDead(f"the engine failed: {self.engine.error or 'the engine core is not running'}")
            return engine_failed(error).to_response()
        # The core listens on this server's address: the client reaches it by the name it reached us by.
        location = request.url.with_scheme("https" if self.info.kv_tls else "http").with_port(port)
        raise web.HTTPTemporaryRedirect(location)

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.model, self.created))

    async def model_card(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the OpenAI SDK's ``models.retrieve``): the served model, or 404."""
        model = request.match_info["model"]
        if model != self.model:
            message = f"The model `{model[:200]}` does not exist."
            return OpenAIError(message, status=404, param="model", code="model_not_found").to_response()
        return json_response(orjson.dumps(model_object(model, self.created)))

    def gauges(self) -> EngineGauges:
        load = self.engine.load()
        return EngineGauges(
            running=load["running"],
            waiting=load["waiting"],
            kv_blocks_used=load["kv_blocks_used"],
            kv_blocks_free=load["kv_blocks_free"],
            gpu_utilization=gpu_utilization(self.info.device),
        )

    async def health(self, request: web.Request) -> web.Response:
        failure = self.failure  # a dead worker rank: red at once, before any step trips over it
        alive = self.engine.alive and failure is None
        info = self.info
        body: dict[str, Any] = {
            "status": "ok" if alive else "error",
            "engine_id": self.config.engine_id,
            "role": self.config.role,
            "model": self.model,
            "block_size": info.block_size,
            "kv_events": True,
            "kv_pull": info.kv_pull,  # pulls from and serves to peers (needs the cache where they are served)
            "token_ids_hex": True,  # takes prompt_token_ids_hex
            "simulated": False,
            "device": info.device,
            "dtype": info.dtype,
            "tensor_parallel_size": info.tensor_parallel_size,
            "pipeline_parallel_size": info.pipeline_parallel_size,
            "engine_core": "thread" if self.llm is not None else "process",
            "load": self.engine.load(),
        }
        if not alive:
            body["error"] = str(self.engine.error or failure or "the engine loop is not running")
        return json_response(orjson.dumps(body), status=200 if alive else 503)

    # -- generation -------------------------------------------------------------------------------------

    async def _generate(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        try:
            reqs = parse_requests(
                await read_body(request),
                kind,
                served_model=self.model,
                tokenizer=self.tokenizer,
                request_id=request_id,
                max_model_len=self.info.max_model_len,
                capabilities=FULL,
                vocab_size=self.info.vocab_size,
            )
            if len(reqs) > 1:  # a completion naming several prompts
                return await serve_batch(self, request, reqs, headers)
            req = reqs[0]
            outputs, first = await self.start(req)
        except OpenAIError as exc:
            return exc.to_response(headers)
        headers.update(self.transfer_headers(req, first))
        async with contextlib.aclosing(outputs):  # closing early (client gone) aborts the request
            if req.stream:
                return await self._stream(request, req, first, outputs, headers)
            return await self._whole(req, first, outputs, headers)

    async def start(self, req: GenerationRequest) -> tuple[Choices, StepOutput]:
        """Start ``req``'s choices, and wait for choice 0's first output: any failure until then is an
        :class:`OpenAIError`, which the client still gets as an HTTP error."""
        outputs = self.choices(req)
        return outputs, await self.first_output(outputs)

    def choices(self, req: GenerationRequest) -> Choices:
        """``req``'s choices, not started yet: ``first_output`` submits choice 0 to the engine."""
        prompt = req.prompt_token_ids.tolist()
        namespace = CacheNamespace(req.cache_salt, req.cache_shared_blocks)

        def start(index: int, params: SamplingParams, transfer: bool) -> AsyncGenerator[StepOutput, None]:
            return self.engine.generate(
                f"{req.request_id}-{req.response_id}" + (f"-{index}" if index else ""),
                prompt,
                params,
                namespace,
                prefill_url=req.prefill_url if transfer else None,
                pull_url=req.kv_pull.url if req.kv_pull and transfer else None,
                pull_tokens=req.kv_pull.tokens if req.kv_pull else 0,
            )

        return Choices(req, start)

    @staticmethod
    async def first_output(outputs: Choices) -> StepOutput:
        """Choice 0's first output; a failure until then is an :class:`OpenAIError`."""
        try:
            return await outputs.first()
        except RequestRejected as exc:
            raise OpenAIError(str(exc), code="context_length_exceeded") from None
        except EngineDead as exc:
            raise engine_failed(exc) from None
        except KvTransferError as exc:
            # Nothing reached the client yet: the gateway may retry with another prefill engine.
            raise OpenAIError(
                str(exc), status=502, error_type="server_error", code="kv_transfer_failed"
            ) from None

    @staticmethod
    def transfer_headers(req: GenerationRequest, first: StepOutput) -> dict[str, str]:
        """Where the prompt's K/V came from, for the gateway."""
        transfer = "remote" if req.prefill_url else "pull" if req.kv_pull else "local"
        return {TRANSFER_HEADER: transfer, TRANSFERRED_HEADER: str(first.kv_transferred_tokens)}

    async def _whole(
        self,
        req: GenerationRequest,
        first: StepOutput,
        rest: Choices,
        headers: dict[str, str],
    ) -> web.Response:
        answer = WholeAnswer(req, self.tokenizer)
        answer.add(0, first)
        async for index, out in rest:
            answer.add(index, out)
        return json_response(answer.body(), headers=headers)

    async def _stream(
        self,
        request: web.Request,
        req: GenerationRequest,
        first: StepOutput,
        rest: Choices,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        response = sse_response(headers)
        answer = StreamAnswer(req, self.tokenizer)
        await response.prepare(request)
        try:
            await response.write(answer.start() + answer.chunk(0, first))
            async for index, out in rest:
                if chunk := answer.chunk(index, out):
                    await response.write(chunk)
            await response.write(answer.end())
            await response.write_eof()
        except EngineDead as exc:
            await end_stream_failed(response, exc)
        except ConnectionResetError:
            pass  # the client left; closing the iterator aborts the request
        return response


ENGINE_SERVER = web.AppKey("kvgate_engine_server", EngineServer)


def build_app(engine: LLMEngine | EngineCoreClient, config: ServerConfig) -> web.Application:
    """The engine's app; with an ``EngineCoreClient`` its lifespan ends by stopping that core process."""
    server = EngineServer(engine, config)
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[openai_routing_errors])
    app[ENGINE_SERVER] = server
    app.cleanup_ctx.append(server.lifespan)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/v1/kv/prefill", server.kv_prefill)
    app.router.add_post("/v1/kv/cached", server.kv_cached)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/v1/models/{model:.+}", server.model_card)  # (ids may hold slashes: org/name)
    app.router.add_get("/health", server.health)
    ResponsesApi(server, config.responses_stored).add_routes(app)
    EmbeddingsApi(server).add_routes(app)
    app.router.add_get("/metrics", metrics_handler(config.engine_id, server.counters, server.gauges))
    server.publisher.add_routes(app)
    return app
