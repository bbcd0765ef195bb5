"""A SIMULATED engine for the Responses API, as vLLM 0.32 serves it with its store on: ``POST
/v1/responses`` answers (whole, or streamed as vLLM streams it: scripted events, or the usual sequence)
and keeps each response; ``GET``/``DELETE /v1/responses/{id}``, ``POST .../cancel`` and ``GET
.../input_items`` answer about kept ones, and a ``previous_response_id`` it does not keep is vLLM's 404. It
records every request, to show where the gateway sent what. As vLLM, it keeps a response under the request's
own ``request_id`` (vLLM's extra field) when it names one."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
from aiohttp import web

from tests.harness import MODEL

USAGE = {
    "input_tokens": 40,
    "input_tokens_details": {"cached_tokens": 32},
    "output_tokens": 3,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 43,
}


def sse_event(kind: str, sequence: int, **fields: Any) -> bytes:
    """An event as vLLM writes it: the ``event:`` line, then the data, whose ``type`` comes last."""
    data = {**fields, "sequence_number": sequence, "type": kind}
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def not_found(response_id: str) -> web.Response:
    error = {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error",
             "param": "response_id", "code": 404}  # fmt: skip
    return web.json_response({"error": error}, status=404)


class ResponsesEngine:
    _ids = itertools.count(1)

    def __init__(self, name: str, *, usage: dict[str, Any] | None = None, model: str = MODEL) -> None:
        self.name = name
        self.model = model
        self.usage = usage or USAGE
        self.kept: dict[str, dict[str, Any]] = {}
        self.bodies: list[dict[str, Any]] = []
        self.asked: list[tuple[str, str]] = []  # (method, path with query) of the requests about kept ones
        self.traced: list[str | None] = []  # their traceparent headers
        self.script: list[bytes] | None = None  # events to stream instead of the usual ones
        self.about_answer: tuple[int, str] | None = None  # (status, text) for requests about kept ones
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/v1/responses", self.create)
        self.app.router.add_route("*", "/v1/responses/{rest:.+}", self.about)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model, "block_size": 16, "kv_events": False})

    def _response(self, body: dict[str, Any], status: str) -> dict[str, Any]:
        # vLLM's ResponsesRequest.request_id (default "resp_<uuid>") is the id it keeps the response under.
        response_id = body.get("request_id") or f"resp_{self.name}_{next(self._ids)}"
        output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                   "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}]  # fmt: skip
        return {"id": response_id, "object": "response", "created_at": 1, "model": body.get("model"),
                "status": status, "output": output, "store": body.get("store", True),
                "previous_response_id": body.get("previous_response_id"), "usage": self.usage}  # fmt: skip

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.kept:
            return not_found(previous)
        done = self._response(body, "completed")
        if done["store"] is not False:
            self.kept[done["id"]] = done
        if not body.get("stream"):
            return web.json_response(done)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = self.script
        if events is None:
            started = {**done, "status": "in_progress", "usage": None}
            events = [sse_event("response.created", 0, response=started)]
            for i, text in enumerate(["Hel", "lo", "!"]):
                fields = {"item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text}
                events.append(sse_event("response.output_text.delta", 1 + i, **fields))
            events.append(sse_event("response.completed", 4, response=done))
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    async def about(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path_qs))
        self.traced.append(request.headers.get("traceparent"))
        if self.about_answer is not None:
            status, text = self.about_answer
            return web.Response(status=status, text=text)
        response_id, _, action = request.match_info["rest"].partition("/")
        kept = self.kept.get(response_id)
        if kept is None:
            return not_found(response_id)
        if request.method == "DELETE":
            del self.kept[response_id]
            return web.json_response({"id": response_id, "object": "response", "deleted": True})
        if action == "input_items":
            return web.json_response({"object": "list", "data": [], "has_more": False})
        return web.json_response(kept)


if __name__ == "__main__":  # (a process of its own: python -m tests.responses_engine PORT NAME)
    import sys

    web.run_app(ResponsesEngine(sys.argv[2]).app, port=int(sys.argv[1]), print=None)
