"""Special-purpose SIMULATED engines for tests: each answers ``/health`` like a good engine (so health
polling alone cannot catch a faulty one) and does one specific thing on completions: hang, fail, flood,
or record what it was sent."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from tests.harness import MODEL, Cluster, ClusterFactory


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "model": MODEL, "block_size": 16, "kv_events": False})


def black_hole() -> web.Application:
    """Accepts every request and never sends a byte back."""

    async def swallow(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.Event().wait()  # forever (until the gateway gives up and disconnects)
        raise AssertionError("unreachable")

    return _app(swallow)


def server_error(status: int = 500) -> web.Application:
    """Answers every completion with an error status before any token."""

    async def fail(request: web.Request) -> web.Response:
        await request.read()
        body = {"error": {"message": "engine exploded", "type": "server_error", "param": None, "code": None}}
        return web.json_response(body, status=status)

    return _app(fail)


class Firehose:
    """Streams an endless SSE answer as fast as the connection takes it, counting the bytes it got rid of
    (``await write`` returns once the transport has room: TCP backpressure reaches it)."""

    def __init__(self) -> None:
        self.written = 0
        self.app = _app(self.stream)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 900 + b'"}}]}\n\n'
        batch = chunk * 64  # ~60 kB per write
        try:
            while True:
                await response.write(batch)
                self.written += len(batch)
        except (ConnectionResetError, RuntimeError):
            pass
        return response


async def _stream_tokens(request: web.Request, tokens: int) -> web.StreamResponse:
    """Start a chat stream: its role chunk, then ``tokens`` one-token chunks."""
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n')
    for _ in range(tokens):
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
    return response


def cut_stream(tokens: int) -> web.Application:
    """Streams a chat answer's role chunk and ``tokens`` one-token chunks, then drops the connection (no
    usage, no [DONE]): an engine that dies mid-stream."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = await _stream_tokens(request, tokens)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return response

    return _app(stream)


def stalls_after(tokens: int) -> web.Application:
    """Streams a chat answer's role chunk and ``tokens`` one-token chunks, then stays silent with the
    connection open (its ``/health`` still fine): a stuck sequence on a live engine."""

    async def stream(request: web.Request) -> web.StreamResponse:
        await _stream_tokens(request, tokens)
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return _app(stream)


def _app(handler: Any) -> web.Application:
    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/chat/completions", handler)
    app.router.add_post("/v1/completions", handler)
    app.router.add_post("/v1/responses", handler)
    return app


class Recorder:
    """Answers every completion with a fixed two-token answer and keeps the headers and bodies it was sent."""

    def __init__(self) -> None:
        self.headers: list[CIMultiDict[str]] = []
        self.bodies: list[dict[str, Any]] = []
        self.app = _app(self.answer)

    async def answer(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.headers.append(request.headers.copy())
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        return web.json_response({"id": "x", "object": "chat.completion", "model": MODEL, "choices": [choice],
                                  "usage": usage})  # fmt: skip


async def recorded_gateway(make_cluster: ClusterFactory) -> tuple[Cluster, Recorder]:
    """A gateway whose one engine is a ``Recorder`` (without KV events): what the gateway sends engines."""
    recorder = Recorder()
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/rec": recorder.app},
        engine_options={"eu-west/rec": {"kv_events": False}},
    )
    return cluster, recorder


def chat_chunk(
    content: str | None = None, *, role: bool = False, finish: str | None = None, usage: Any = None
) -> bytes:
    """One SSE event of a chat stream as vLLM writes it: a role announcement, a token, or (``usage`` with no
    ``content``) the usage chunk with ``choices: []``."""
    base: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1}
    base["model"] = MODEL
    if usage is not None and content is None and not role:
        return b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
    delta = {"role": "assistant", "content": ""} if role else {"content": content}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    chunk = {**base, "choices": [choice], **({"usage": usage} if usage is not None else {})}
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def usage_of(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Scripted:
    """Streams exactly the SSE bytes it is given, then ends its response cleanly (a whole chunked body,
    keep-alive): an engine whose HTTP is fine and whose stream is not. The bytes before ``pause_at`` go
    out first; the rest wait for ``resume`` (set by the test once its client has seen them), so that the
    gateway reads the two parts as separate batches."""

    def __init__(self, events: list[bytes], *, pause_at: int | None = None) -> None:
        self.events = events
        self.pause_at = len(events) if pause_at is None else pause_at
        self.resume = asyncio.Event()
        self.bodies: list[dict[str, Any]] = []
        self.app = _app(self.stream)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, event in enumerate(self.events):
            if i == self.pause_at:
                await self.resume.wait()
            await response.write(event)
        await response.write_eof()
        return response


def answers(body: bytes, content_type: str = "application/json", status: int = 200) -> web.Application:
    """Answers every completion ``status`` with ``body`` as it is, whatever was asked (streams included)."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type=content_type, status=status)

    return _app(answer)


class Busy:
    """Answers every completion with ``status`` (429 or 503: too busy) and, when given, a ``Retry-After``
    header, before any token; counts the completions it was sent."""

    def __init__(self, status: int = 503, retry_after: str | None = None) -> None:
        self.status = status
        self.retry_after = retry_after
        self.requests = 0
        self.app = _app(self.refuse)

    async def refuse(self, request: web.Request) -> web.Response:
        await request.read()
        self.requests += 1
        body = {"error": {"message": "too busy", "type": "server_error", "param": None, "code": None}}
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
        return web.json_response(body, status=self.status, headers=headers)


class EndsAfterDone:
    """Streams a two-token chat answer and ``[DONE]``, then ends its response ``end_after_s`` later (the
    chunked body's terminator; None: never, it holds the response open until the gateway disconnects).
    Notes the connection (the gateway's address) of each completion, how many responses it ended, and how
    many the gateway dropped while they were still open (its handler is cancelled then)."""

    def __init__(self, end_after_s: float | None) -> None:
        self.end_after_s = end_after_s
        self.peers: list[Any] = []
        self.ended = 0
        self.dropped = 0
        self.finished = 0  # handlers done, either way
        self.app = _app(self.stream)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        transport = request.transport
        assert transport is not None
        self.peers.append(transport.get_extra_info("peername"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = usage_of(5, 2)
        for event in (chat_chunk(role=True), chat_chunk("x"), chat_chunk("x", finish="stop")):
            await response.write(event)
        await response.write(chat_chunk(usage=usage) + b"data: [DONE]\n\n")
        try:
            if self.end_after_s is not None:
                await asyncio.sleep(self.end_after_s)
                await response.write_eof()
                self.ended += 1
            else:
                await asyncio.Event().wait()  # until the gateway disconnects: the handler is cancelled then
        except asyncio.CancelledError:
            self.dropped += 1
            raise
        finally:
            self.finished += 1
        return response
