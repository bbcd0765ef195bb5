"""One exception hierarchy for the gateway, mapped to OpenAI-shaped JSON error responses in one place."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

from aiohttp import web

from gateway import json_text
from gateway.http.retry_after import retry_after_headers

E = TypeVar("E", bound="GatewayError")
UNAVAILABLE_RETRY_AFTER_S = 1  # the wait a 503 raised without one of its own says


class GatewayError(Exception):
    """An error with an HTTP status and an OpenAI error body: ``{"error": {message, type, param, code}}``."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def with_headers(self: E, headers: Mapping[str, str]) -> E:
        """A copy of this error that also carries ``headers`` (its own kept where both name one: it knows
        its own wait); this one is left as it is. An error may be shared, as one failed read is by every
        read that joined it: headers set on it in place would reach callers they do not belong to."""
        twin = copy.copy(self)  # (its class, message, code, and a ``type`` set on the instance)
        twin.headers = {**headers, **self.headers}
        return twin

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = self.headers
        if self.status == 503 and not any(name.lower() == "retry-after" for name in headers):
            # Every 503 says when to come back, those raised without a wait of their own too (an engine
            # holding a stored response down, the ledger unreadable): a client without a backoff of its
            # own retried at once. A copy: the error may be shared (see ``with_headers``).
            headers = {**retry_after_headers(UNAVAILABLE_RETRY_AFTER_S), **headers}
        return web.Response(
            status=self.status,
            body=json_text.dumps(self.body()),  # (a message may quote a client's bytes that are not UTF-8)
            content_type="application/json",
            headers=headers,
        )

    def sse_event(self) -> bytes:
        """The error as the event that ends a stream whose answer already began."""
        return b"data: " + json_text.dumps(self.body()) + b"\n\n"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "insufficient_permissions"


class Unavailable(GatewayError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimedOut(GatewayError):
    """The request's head or body did not arrive in time: the rest of it is never read, so the connection
    closes after this answer."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def response(self) -> web.Response:
        response = super().response()
        response.force_close()  # aiohttp then says Connection: close (the lean server always does)
        return response


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamFailed(GatewayError):
    status = 502
    type = "server_error"
    code = "upstream_error"


class NoCapacity(GatewayError):
    """No engine can take the request now (none healthy, or all saturated)."""

    status = 503
    type = "server_error"
    code = "no_engine_available"


class Overloaded(NoCapacity):
    """Every engine that could serve the request is at its admission limit: come back shortly."""

    code = "engines_overloaded"


class UpstreamTimedOut(GatewayError):
    status = 504
    type = "server_error"
    code = "upstream_timeout"
