"""The error a kvgate engine answers a bad request with: OpenAI's ``{"error": {...}}`` body, as JSON."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import orjson
from aiohttp import web

JSON_CONTENT_TYPE = "application/json"
# The engines' request bodies: the token ids of a long prompt outgrow aiohttp's 1 MiB default.
MAX_BODY_BYTES = 64 * 2**20


class OpenAIError(Exception):
    """A request the engine refuses, rendered as OpenAI's ``{"error": {...}}`` body with a 4xx status."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def to_response(self, headers: Mapping[str, str] | None = None) -> web.Response:
        return json_response(self.body(), status=self.status, headers=headers)


def json_response(
    body: bytes, *, status: int = 200, headers: Mapping[str, str] | None = None
) -> web.Response:
    return web.Response(body=body, status=status, content_type=JSON_CONTENT_TYPE, headers=headers)


async def read_body(request: web.Request) -> bytes:
    """The request's body (the engines' apps take up to ``MAX_BODY_BYTES``). One over the limit is OpenAI's
    413 JSON error: aiohttp's own is text/plain, a body that a peer's importer, a router's tokenizer client
    or an SDK cannot read as the error it is."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413) from None


@web.middleware
async def openai_routing_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """What no route takes, as OpenAI-shaped errors (404 ``not_found``, 405 ``method_not_allowed`` with its
    ``Allow``), as the gateway answers them: aiohttp's text/plain reached the SDKs as a body they could not
    read. Only routing raises these here; a handler's other HTTP errors (the KV event feed's) are kept.
    kvgate's engine and the simulated one both answer with it."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        error = OpenAIError(f"method not allowed; use {', '.join(sorted(exc.allowed_methods))}",
                            status=405, code="method_not_allowed")  # fmt: skip
        return error.to_response({"Allow": exc.headers.get("Allow", "")})
    except web.HTTPNotFound:
        return OpenAIError("no such endpoint", status=404, code="not_found").to_response()
