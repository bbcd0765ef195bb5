"""The lean server's route table: which handler answers a method on a path, and for what no route answers,
the error a client of an HTTP API expects (404 for an unknown path, 405 with ``Allow`` for a method the path
does not take). A GET route answers HEAD too, as aiohttp's and every web framework's do."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.http.errors import GatewayError, MethodNotAllowed, NotFound

if TYPE_CHECKING:
    from gateway.http.http_wire import Answer
    from gateway.http.lean_request import LeanRequest

# A handler: the request -> the whole answer, or a finished LeanStream.
LeanHandler = Callable[["LeanRequest"], Awaitable["Answer"]]
UNMATCHED = "unmatched"  # the endpoint label of a request no route takes


@dataclass(frozen=True, slots=True)
class Route:
    """``path`` is exact, or ends in one ``{name}`` segment (``/dashboard/assets/{name}``): the segment's
    text is then the request's ``match_info[name]``; ``{name:path}`` takes the rest of the path, slashes
    included (``/v1/models/{model:path}``: model ids such as ``meta-llama/Llama-3.1-8B``). ``key_first``:
    with authentication on, the request's key is checked once its headers are in, before its body is read
    (the completion endpoints)."""

    path: str
    methods: Mapping[str, LeanHandler]
    key_first: bool = False


@dataclass(frozen=True, slots=True)
class Found:
    """What a request gets: a handler, or the error no route's handler answers (``handler`` None)."""

    endpoint: str  # the metrics label: the route's path (its pattern), or UNMATCHED
    handler: LeanHandler | None
    error: GatewayError | None = None
    key_first: bool = False
    match_info: dict[str, str] = field(default_factory=dict)


class Routes:
    """Routes by exact path (one dict probe on the hot path), then by pattern."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self._exact: dict[str, Route] = {}
        # (prefix, parameter name, whether it takes slashes too, route)
        self._patterns: list[tuple[str, str, bool, Route]] = []
        for route in routes:
            prefix, brace, rest = route.path.partition("{")
            if brace:
                if not rest.endswith("}") or "/" in rest:
                    raise ValueError(f"a route's parameter is its last segment: {route.path!r}")
                name, _, kind = rest[:-1].partition(":")
                if kind not in ("", "path"):
                    raise ValueError(f"a route's parameter is {{name}} or {{name:path}}: {route.path!r}")
                self._patterns.append((prefix, name, kind == "path", route))
            else:
                self._exact[route.path] = route
        # What the exact routes answer, found once: a request to one costs a dict probe, no allocation.
        self._found = {
            (method, path): self._find(method, path)
            for path, route in self._exact.items()
            for method in allowed_methods(route)
        }

    def __bool__(self) -> bool:
        return bool(self._exact or self._patterns)

    def find(self, method: str, path: str) -> Found:
        found = self._found.get((method, path))
        return found if found is not None else self._find(method, path)

    def _find(self, method: str, path: str) -> Found:
        route = self._exact.get(path)
        match_info: dict[str, str] = {}
        if route is None:
            for prefix, name, slashes, candidate in self._patterns:
                value = path[len(prefix) :]
                if path.startswith(prefix) and value and (slashes or "/" not in value):
                    route, match_info = candidate, {name: value}
                    break
            else:
                return Found(UNMATCHED, None, NotFound("no such endpoint", code="not_found"))
        handler = route.methods.get(method)
        if handler is None and method == "HEAD":
            handler = route.methods.get("GET")
        if handler is None:
            allowed = ", ".join(allowed_methods(route))
            error = MethodNotAllowed(f"method not allowed; use {allowed}", headers={"Allow": allowed})
            return Found(route.path, None, error)
        return Found(route.path, handler, key_first=route.key_first, match_info=match_info)


def allowed_methods(route: Route) -> list[str]:
    methods = sorted(route.methods)
    return [*methods, "HEAD"] if "GET" in methods and "HEAD" not in methods else methods
