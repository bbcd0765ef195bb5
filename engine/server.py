"""kvgate's engine over HTTP: the OpenAI API and KV events of the simulator, served by a real model."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import ssl
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from engine.async_engine import AsyncEngine, EngineDead
from engine.engine_types import RequestRejected, StepOutput
from engine.kv_import import KvImporter
from engine.kv_publisher import KvEventPublisher
from engine.kv_send import write_frames
from engine.kv_source_request import parse_kv_source_request
from engine.kv_transfer import CONTENT_TYPE as KV_CONTENT_TYPE
from engine.kv_transfer import KvTransferError, StagedFrame
from engine.kv_wire import head as kv_head
from engine.llm_engine import EngineConfig, LLMEngine
from engine.metrics import EngineGauges, gpu_utilization, metrics_handler
from engine.openai_api import GenerationRequest, RequestKind, new_request_id, parse_request
from engine.openai_choices import Choices, StreamAnswer, WholeAnswer
from engine.openai_errors import OpenAIError, json_response
from engine.openai_format import models_body, sse_response
from engine.openai_sampling import FULL
from engine.sequence import CacheNamespace, SamplingParams

REQUEST_ID_HEADER = "x-request-id"
# remote: the prompt's K/V came from a prefill engine; pull: a pull from a peer's cache was asked for; local
TRANSFER_HEADER = "x-kvgate-kv-transfer"
TRANSFERRED_HEADER = "x-kvgate-kv-transferred-tokens"  # positions whose K/V arrived (0 after a failed pull)
ROLES = ("prefill", "decode", "both")
MAX_BODY_BYTES = 64 * 2**20  # the token ids of a long prompt outgrow aiohttp's 1 MiB default


@dataclass(frozen=True)
class ServerConfig:
    engine_id: str
    host: str = "127.0.0.1"
    port: int = 0
    role: str = "both"


class EngineServer:
    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        if config.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {config.role!r}")
        self.config = config
        self.llm = engine
        self.publisher = KvEventPublisher(config.engine_id, engine.config.block_size)
        # KV transfer needs the cache in this process: a tp/pp engine's lives in its workers.
        cache = engine.kv_cache
        self.importer = KvImporter(cache, engine.model_name) if cache is not None else None
        self.engine = AsyncEngine(engine, on_kv_events=self.publisher.publish, kv_fetcher=self.importer)
        self.created = int(time.time())

    @property
    def model(self) -> str:
        return self.llm.model_name

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
        return await self._kv_source(request, self.engine.export)

    async def kv_cached(self, request: web.Request) -> web.StreamResponse:
        """A peer's KV pull: stream the K/V that this engine's prefix cache holds of a prompt's positions
        ``from_position`` on, computing nothing and waiting behind no request; the done frame says how far
        it got. The blocks sent are evicted first from now on: the peer holds them."""
        return await self._kv_source(request, self.engine.export_cached)

    async def _kv_source(
        self,
        request: web.Request,
        open_frames: Callable[[str, list[int], CacheNamespace, int], AsyncGenerator[StagedFrame, None]],
    ) -> web.StreamResponse:
        """Check a KV transfer request (the body ``KvImporter`` sends), then stream the frames
        ``open_frames(request id, prompt token ids, namespace, from_position)`` yields, their payloads
        written as they are (``engine.kv_send``)."""
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        try:
            req = parse_kv_source_request(
                await request.read(), served_model=self.model, block_size=self.llm.config.block_size
            )
            namespace = CacheNamespace(req.cache_salt, req.cache_shared_blocks)
            ids = req.prompt_token_ids.tolist()
            frames = open_frames(f"kv-{request_id}-{new_request_id()}", ids, namespace, req.from_position)
            first = await anext(frames)
        except OpenAIError as exc:
            return exc.to_response()
        except RequestRejected as exc:
            return OpenAIError(str(exc)).to_response()
        except EngineDead as exc:
            return _engine_failed(exc).to_response()
        response = web.StreamResponse(headers={REQUEST_ID_HEADER: request_id})
        response.content_type = KV_CONTENT_TYPE
        async with contextlib.aclosing(frames):  # the receiving engine hanging up aborts the prefill
            try:
                await write_frames(request, response, first, frames)
                await response.write_eof()
            except EngineDead as exc:
                with contextlib.suppress(ConnectionResetError):
                    await response.write(kv_head({"t": "error", "message": str(exc)}))
            except ConnectionResetError:
                pass
        return response

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.model, self.created))

    def gauges(self) -> EngineGauges:
        load = self.engine.load()
        return EngineGauges(
            running=load["running"],
            waiting=load["waiting"],
            kv_blocks_used=load["kv_blocks_used"],
            kv_blocks_free=load["kv_blocks_free"],
            gpu_utilization=gpu_utilization(self.llm.device),
        )

    async def health(self, request: web.Request) -> web.Response:
        failure = self.llm.failure  # a dead worker rank: red at once, before any step trips over it
        alive = self.engine.alive and failure is None
        body: dict[str, Any] = {
            "status": "ok" if alive else "error",
            "engine_id": self.config.engine_id,
            "role": self.config.role,
            "model": self.model,
            "block_size": self.llm.config.block_size,
            "kv_events": True,
            "kv_pull": self.importer is not None,  # pulls from and serves to peers (needs the cache here)
            "token_ids_hex": True,  # takes prompt_token_ids_hex
            "simulated": False,
            "device": str(self.llm.device),
            "dtype": str(self.llm.dtype).removeprefix("torch."),
            "tensor_parallel_size": self.llm.config.tensor_parallel_size,
            "pipeline_parallel_size": self.llm.config.pipeline_parallel_size,
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
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise OpenAIError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413) from None
            req = parse_request(
                body,
                kind,
                served_model=self.model,
                tokenizer=self.llm.tokenizer,
                request_id=request_id,
                max_model_len=self.llm.max_model_len,
                capabilities=FULL,
                vocab_size=self.llm.model_config.vocab_size,
            )
            prompt = req.prompt_token_ids.tolist()
            namespace = CacheNamespace(req.cache_salt, req.cache_shared_blocks)

            def start(index: int, params: SamplingParams, transfer: bool) -> AsyncGenerator[StepOutput, None]:
                return self.engine.generate(
                    f"{request_id}-{req.response_id}" + (f"-{index}" if index else ""),
                    prompt,
                    params,
                    namespace,
                    prefill_url=req.prefill_url if transfer else None,
                    pull_url=req.kv_pull.url if req.kv_pull and transfer else None,
                    pull_tokens=req.kv_pull.tokens if req.kv_pull else 0,
                )

            outputs = Choices(req, start)
            first = await outputs.first()  # errors before the first token still become an HTTP error
        except OpenAIError as exc:
            return exc.to_response(headers)
        except RequestRejected as exc:
            return OpenAIError(str(exc), code="context_length_exceeded").to_response(headers)
        except EngineDead as exc:
            return _engine_failed(exc).to_response(headers)
        except KvTransferError as exc:
            # Nothing reached the client yet: the gateway may retry with another prefill engine.
            error = OpenAIError(str(exc), status=502, error_type="server_error", code="kv_transfer_failed")
            return error.to_response(headers)
        headers[TRANSFER_HEADER] = "remote" if req.prefill_url else "pull" if req.kv_pull else "local"
        headers[TRANSFERRED_HEADER] = str(first.kv_transferred_tokens)
        async with contextlib.aclosing(outputs):  # closing early (client gone) aborts the request
            if req.stream:
                return await self._stream(request, req, first, outputs, headers)
            return await self._whole(req, first, outputs, headers)

    async def _whole(
        self,
        req: GenerationRequest,
        first: StepOutput,
        rest: Choices,
        headers: dict[str, str],
    ) -> web.Response:
        answer = WholeAnswer(req, self.llm.tokenizer)
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
        answer = StreamAnswer(req, self.llm.tokenizer)
        await response.prepare(request)
        try:
            await response.write(answer.start() + answer.chunk(0, first))
            async for index, out in rest:
                if chunk := answer.chunk(index, out):
                    await response.write(chunk)
            await response.write(answer.end())
            await response.write_eof()
        except EngineDead as exc:
            error = _engine_failed(exc)
            with contextlib.suppress(ConnectionResetError):
                await response.write(b"data: " + error.body() + b"\n\n")
        except ConnectionResetError:
            pass  # the client left; closing the iterator aborts the request
        return response


def _engine_failed(exc: BaseException) -> OpenAIError:
    return OpenAIError(str(exc), status=503, error_type="server_error", code="engine_failed")


ENGINE_SERVER = web.AppKey("kvgate_engine_server", EngineServer)


def build_app(engine: LLMEngine, config: ServerConfig) -> web.Application:
    server = EngineServer(engine, config)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[ENGINE_SERVER] = server
    app.cleanup_ctx.append(server.lifespan)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat)
    app.router.add_post("/v1/kv/prefill", server.kv_prefill)
    app.router.add_post("/v1/kv/cached", server.kv_cached)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", metrics_handler(config.engine_id, engine.counters, server.gauges))
    server.publisher.add_routes(app)
    return app


def serve(
    engine_config: EngineConfig, server_config: ServerConfig, *, ssl_context: ssl.SSLContext | None = None
) -> int:
    """Load the model, serve until SIGINT/SIGTERM (on uvloop when installed), over https:// when given
    ``ssl_context``; returns the exit status."""
    try:
        import uvloop

        loop_factory: Any = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    engine = LLMEngine(engine_config)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(_serve(engine, server_config, ssl_context))
    finally:
        engine.close()  # a tp/pp engine's worker processes


async def _serve(engine: LLMEngine, config: ServerConfig, ssl_context: ssl.SSLContext | None) -> int:
    runner = web.AppRunner(
        build_app(engine, config), handler_cancellation=True, access_log=None, shutdown_timeout=5
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, backlog=2048, ssl_context=ssl_context).start()
        host, port = runner.addresses[0][:2]
        scheme = "http" if ssl_context is None else "https"
        blocks = f"{engine.blocks.num_blocks} KV blocks of {engine.config.block_size}"
        if engine.config.parallel.world_size > 1:
            parallel = engine.config.parallel
            blocks += f", tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size}"
        print(
            f"kvgate engine {config.engine_id}: serving {engine.model_name!r} "
            f"({engine.dtype}, {engine.device}, {blocks}) on {scheme}://{host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
