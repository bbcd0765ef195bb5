"""kvgate's engine's ``POST /v1/embeddings`` (the request and answer: ``engine.embeddings_api``; the model's
side: ``engine.embedding``). Each input is embedded as a request of its own, all of them at once, on the
engine thread here or in the engine core process; a client that leaves drops those not yet computed."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import numpy as np
from aiohttp import web

from engine.async_engine import EngineDead
from engine.embeddings_api import EMBEDDINGS_PATH, EmbeddingRequest, embeddings_body, parse_embedding_request
from engine.engine_types import RequestRejected
from engine.kv_serve import REQUEST_ID_HEADER, engine_failed
from engine.openai_api import new_request_id
from engine.openai_errors import OpenAIError, json_response, read_body
from engine.sequence import CacheNamespace

if TYPE_CHECKING:
    from engine.server import EngineServer


class EmbeddingsApi:
    """The embeddings route of one engine server."""

    def __init__(self, server: EngineServer) -> None:
        self._server = server

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(EMBEDDINGS_PATH, self.create)

    async def create(self, request: web.Request) -> web.Response:
        server = self._server
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        info = server.info
        try:
            req = parse_embedding_request(
                await read_body(request),
                served_model=server.model,
                tokenizer=server.tokenizer,
                request_id=request_id,
                max_model_len=info.max_model_len,
                vocab_size=info.vocab_size,
            )
            if info.tensor_parallel_size * info.pipeline_parallel_size > 1:
                # Its model lives in worker processes, which compute steps only (engine.embedding).
                raise OpenAIError("embeddings are not served by a tensor- or pipeline-parallel engine")
            vectors = await self._embed(req)
        except OpenAIError as exc:
            return exc.to_response(headers)
        server.counters.embedded(req.prompt_tokens)
        return json_response(embeddings_body(req, vectors), headers=headers)

    async def _embed(self, req: EmbeddingRequest) -> list[np.ndarray]:
        """The last hidden state of each input; the first failure cancels the others."""
        engine, namespace = self._server.engine, CacheNamespace(req.cache_salt)
        prefix = f"{req.request_id}-{req.response_id}"
        tasks = [
            asyncio.ensure_future(engine.embed(f"{prefix}-{i}", ids.tolist(), namespace))
            for i, ids in enumerate(req.inputs)
        ]
        for task in tasks:  # one that fails after another did is never awaited: retrieve its error
            task.add_done_callback(_retrieve)
        try:
            return [await task for task in tasks]
        except RequestRejected as exc:
            raise OpenAIError(str(exc), param="input") from None
        except EngineDead as exc:
            raise engine_failed(exc) from None
        except Exception as exc:  # the model failed on this prompt alone: the engine still serves
            raise OpenAIError(f"the embedding failed: {exc}", status=500, error_type="server_error") from None
        finally:
            for task in tasks:
                task.cancel()  # (nothing for those done)


def _retrieve(task: asyncio.Future[np.ndarray]) -> None:
    if not task.cancelled():
        task.exception()
