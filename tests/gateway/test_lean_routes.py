"""The lean server's route table: exact paths, one-segment and rest-of-path parameters, HEAD, 404 and 405."""

from __future__ import annotations

import pytest

from gateway.http.errors import MethodNotAllowed, NotFound
from gateway.http.lean_request import LeanRequest
from gateway.http.lean_routes import UNMATCHED, Route, Routes


async def handler(request: LeanRequest) -> bytes:
    return b""


ROUTES = Routes(
    [
        Route("/v1/models", {"GET": handler}),
        Route("/v1/models/{model:path}", {"GET": handler}),
        Route("/dashboard/assets/{name}", {"GET": handler}),
        Route("/v1/completions", {"POST": handler}, key_first=True),
    ]
)


def test_rest_of_path_parameters_take_slashes_and_segments_do_not() -> None:
    found = ROUTES.find("GET", "/v1/models/meta-llama/Llama-3.1-8B")
    assert found.handler is handler and found.match_info == {"model": "meta-llama/Llama-3.1-8B"}
    assert ROUTES.find("GET", "/v1/models/tiny").match_info == {"model": "tiny"}
    assert ROUTES.find("GET", "/v1/models").match_info == {}  # the exact route, not an empty parameter
    assert ROUTES.find("GET", "/dashboard/assets/app.js").match_info == {"name": "app.js"}
    nested = ROUTES.find("GET", "/dashboard/assets/a/b.js")
    assert nested.endpoint == UNMATCHED and isinstance(nested.error, NotFound)


def test_methods() -> None:
    assert ROUTES.find("HEAD", "/v1/models/x").handler is handler  # GET answers HEAD
    post = ROUTES.find("POST", "/v1/models/x")
    assert post.handler is None and isinstance(post.error, MethodNotAllowed)
    assert post.error.headers == {"Allow": "GET, HEAD"} and post.endpoint == "/v1/models/{model:path}"
    assert ROUTES.find("POST", "/v1/completions").key_first


@pytest.mark.parametrize("path", ["/a/{x}/b", "/a/{x:int}", "/a/{x"])
def test_parameters_other_than_a_last_segment_or_the_rest_are_refused(path: str) -> None:
    with pytest.raises(ValueError, match="parameter"):
        Routes([Route(path, {"GET": handler})])
