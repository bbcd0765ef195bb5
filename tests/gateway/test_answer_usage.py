"""A large whole answer's usage read and rewritten at its end (gateway.http.answer_usage), where parsing and
writing out a 157 MB embeddings answer held the event loop for about a second."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

import gateway.http.relay as relay
from gateway.http.answer_usage import TAIL_USAGE_BYTES, tail_usage
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
        replaced = found.replaced({**found.usage, "cost": 0.5})
        assert orjson.loads(replaced) == {**orjson.loads(body), "usage": {**usage, "cost": 0.5}}  # type: ignore[dict-item]


async def test_a_large_embeddings_answer_is_relayed_and_billed_without_being_parsed_whole(
    make_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    whole = relay.answer_object
    monkeypatch.setattr(
        relay, "answer_object", lambda e, data, m: parsed.append(len(data)) or whole(e, data, m)
    )
    cluster = await make_cluster(
        {"eu-west": 1}, prices={MODEL: {"input": 1, "cached_input": 0.1, "output": 2}}
    )
    inputs = [f"document {i}" for i in range(2048)]
    status, answer, _ = await cluster.post("/v1/embeddings", {"model": MODEL, "input": inputs})
    assert status == 200 and len(answer["data"]) == 2048
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(len(text) for text in inputs)  # (the simulator's tokens are bytes)
    assert usage["cost"] == pytest.approx(usage["prompt_tokens"] / 1e6)
    assert not [size for size in parsed if size > TAIL_USAGE_BYTES]  # (it was parsed whole: 1.6 MB)
    small = await cluster.post("/v1/embeddings", {"model": MODEL, "input": "one"})
    assert small[0] == 200 and small[1]["usage"]["cost"] > 0 and parsed  # (a small one is, as before)
