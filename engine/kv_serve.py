"""The KV source routes' handler (``/v1/kv/prefill``, ``/v1/kv/cached``): check the request a receiving
engine's ``KvImporter`` sends, then stream the frames. Served by the engine's HTTP server in thread mode,
and by the engine core's own small server in process mode (``engine.core``), where the K/V cache lives."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable

from aiohttp import web

from engine.async_engine import EngineDead
from engine.engine_types import RequestRejected
from engine.kv_send import write_frames
from engine.kv_source_request import parse_kv_source_request
from engine.kv_transfer import CONTENT_TYPE as KV_CONTENT_TYPE
from engine.kv_transfer import StagedFrame
from engine.kv_wire import head as kv_head
from engine.openai_api import new_request_id
from engine.openai_errors import MAX_BODY_BYTES, OpenAIError, read_body
from engine.sequence import CacheNamespace

REQUEST_ID_HEADER = "x-request-id"
__all__ = ["MAX_BODY_BYTES", "REQUEST_ID_HEADER", "OpenFrames", "engine_failed", "serve_kv_source"]

# (request id, prompt token ids, namespace, from_position) -> the frames to send
OpenFrames = Callable[[str, list[int], CacheNamespace, int], AsyncGenerator[StagedFrame, None]]


def engine_failed(exc: BaseException) -> OpenAIError:
    """The OpenAI-shaped error of a request that the failed engine cannot serve (503)."""
    return OpenAIError(str(exc), status=503, error_type="server_error", code="engine_failed")


async def end_stream_failed(response: web.StreamResponse, exc: BaseException) -> None:
    """End an answer already streaming with the engine's failure as an SSE error event (a client that has
    left meanwhile gets nothing)."""
    with contextlib.suppress(ConnectionResetError):
        await response.write(b"data: " + engine_failed(exc).body() + b"\n\n")


async def serve_kv_source(
    request: web.Request, open_frames: OpenFrames, *, model: str, block_size: int, max_model_len: int
) -> web.StreamResponse:
    """Check a KV transfer request (the body ``KvImporter`` sends), then stream the frames
    ``open_frames(request id, prompt token ids, namespace, from_position)`` yields, their payloads written
    as they are (``engine.kv_send``)."""
    request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
    try:
        req = parse_kv_source_request(
            await read_body(request), served_model=model, block_size=block_size, max_model_len=max_model_len
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
        return engine_failed(exc).to_response()
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
