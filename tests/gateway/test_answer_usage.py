"""A large whole answer's usage read and rewritten at its end (gateway.http.answer_usage), where parsing and
writing out a 157 MB embeddings answer held the event loop for about a second."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from aiohttp import web

from gateway.http.answer_usage import TAIL_USAGE_BYTES, tail_usage
from gateway.http.http_wire import WholeAnswer
from tests.harness import MODEL, ClusterFactory


@pytest.mark.parametrize(
    ("body", "usage"),
    [
        (b'{"a":1,"usage":{"prompt_tokens":3}}', {"prompt_tokens": 3}),
        (b' {"a":1, "usage" : {"prompt_tokens":3} } \n', {"prompt_tokens": 3}),
        (b'{"a":"usage","usage":{"k":1}}', {"k": 1}),
        (b'{"data":[{"usage":{"a":1}}]}', None),  # (in another member's value)
        (b'{"o":{"i":1,"usage":{"k":1}}}', None),
        (b'{"usage":{"k":1},"b":2}', None),  # (not the last member: parsed whole)
        (b'{"usage":null}', None),
        (b'{"t":"x\\"usage\\":{}"}', None),  # (in a string)
        (b"[1]", None),
        (b"", None),
        (b"}", None),
    ],
)
def test_the_usage_is_found_only_as_the_last_member_of_the_outer_object(
    body: bytes, usage: dict[str, Any] | None
) -> None:
    found = tail_usage(body)
    assert (found.usage if found is not None else None) == usage
    if found is not None:
        replaced = b"".join(found.replaced({**found.usage, "cost": 0.5}))
        assert orjson.loads(replaced) == {**orjson.loads(body), "usage": {**usage, "cost": 0.5}}  # type: ignore[dict-item]


def test_a_large_answer_is_written_from_its_engines_bytes_without_a_copy() -> None:
    # The parts written are the engine's bytes themselves around the new usage, and the head frames their
    # whole length: a copy of a 160 MB answer (joined, or behind its head) held the event loop 0.1 s each.
    body = b'{"data":"' + b"x" * TAIL_USAGE_BYTES + b'","usage":{"prompt_tokens":3}}'
    found = tail_usage(body)
    assert found is not None
    answer = WholeAnswer(found.replaced({**found.usage, "cost": 0.5}), {"x-request-id": "r"})
    head, *parts = answer.wire(keep_alive=True)
    assert [p.obj for p in parts if isinstance(p, memoryview)] == [body, body]
    framed = bytes(head)
    length = int(framed.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    assert length == sum(len(p) for p in parts) == len(answer.content()) == len(body) + len(b',"cost":0.5')
    assert framed.endswith(b"\r\n\r\n") and b"x-request-id: r\r\n" in framed
    whole = WholeAnswer(body, {})
    assert whole.wire(keep_alive=True)[1] is body  # (not copied behind its head either)
    assert isinstance(WholeAnswer(b"{}", {}).wire(keep_alive=True), bytes)  # (a small one: one write)


class SpacedEmbeddings:
    """A SIMULATED engine answering every embeddings request with ``count`` vectors in JSON as Python's
    ``json`` writes it (a space after each separator, where orjson writes none): an answer the gateway parsed
    and wrote out again reaches the client without those spaces."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.app = web.Application()
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/v1/embeddings", self._embeddings)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": MODEL, "block_size": 16, "kv_events": False})

    async def _embeddings(self, request: web.Request) -> web.Response:
        data = [{"index": i, "object": "embedding", "embedding": [0.25] * 64} for i in range(self.count)]
        usage = {"prompt_tokens": 7, "total_tokens": 7}
        body = {"id": "embd-1", "object": "list", "created": 1, "model": MODEL, "data": data, "usage": usage}
        return web.Response(body=json.dumps(body).encode(), content_type="application/json")


@pytest.mark.parametrize("count", [4, 4096])
async def test_a_large_answer_is_relayed_as_its_engine_wrote_it_and_billed(
    make_cluster: ClusterFactory, count: int
) -> None:
    engine = SpacedEmbeddings(count)
    cluster = await make_cluster(
        {"eu-west": 0},
        extra_engines={"eu-west/e0": engine.app},
        engine_options={"eu-west/e0": {"kv_events": False}},
        prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}},
    )
    assert cluster.session is not None
    body = {"model": MODEL, "input": "one document"}
    async with cluster.session.post(cluster.url + "/v1/embeddings", json=body) as answer:
        assert answer.status == 200
        raw = await answer.read()
    parsed = orjson.loads(raw)
    assert len(parsed["data"]) == count and parsed["usage"]["prompt_tokens"] == 7
    assert parsed["usage"]["cost"] == pytest.approx(7 / 1e6)
    # A large one (4096 vectors, 1.5 MB) keeps its engine's bytes but for its usage; a small one is parsed
    # whole and written out again, as every answer was (the large one too, before).
    assert (b'"index": 0, "object": "embedding"' in raw) == (len(raw) > TAIL_USAGE_BYTES)
    assert raw.endswith(b'"usage": {"prompt_tokens":7,"total_tokens":7,"cost":7e-6}}') == (count == 4096)
