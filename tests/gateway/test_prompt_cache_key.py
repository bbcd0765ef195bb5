"""OpenAI's ``prompt_cache_key`` (the SDK's way to ask that requests sharing a key stay together) names a
session as ``x-session-affinity`` does, for clients that never send kvgate's header."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.http.errors import InvalidRequest
from gateway.session_key import session_id
from tests.harness import MODEL, ClusterFactory


def turn(topic: str) -> list[dict[str, str]]:
    """A prompt sharing no block with another topic's: only the session can keep them together."""
    return [{"role": "user", "content": f"[{topic}] " + " ".join(f"{topic}-{i}" for i in range(80))}]


async def test_requests_sharing_a_prompt_cache_key_stay_on_one_engine(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 4})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    engines, routes = set(), []
    for topic in "abcdef":
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=turn(topic),
            max_tokens=2,
            prompt_cache_key="agent-7",  # type: ignore[arg-type]
        )
        engines.add(raw.headers["x-kvgate-engine"])
        routes.append(raw.headers["x-kvgate-route"])
    # (Without the key, six unrelated prompts spread over the four engines by load.)
    assert len(engines) == 1 and routes[1:] == ["session"] * 5, routes
    # The same value as kvgate's header is the same session: a client may move from one to the other.
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=turn("g"), max_tokens=2, extra_headers={"x-session-affinity": "agent-7"}
    )
    assert raw.headers["x-kvgate-engine"] in engines and raw.headers["x-kvgate-route"] == "session"
    await client.close()


async def test_the_header_wins_over_the_body_key(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 2})
    first = {"model": MODEL, "messages": turn("a"), "max_tokens": 2, "prompt_cache_key": "k1"}
    assert (await cluster.post("/v1/chat/completions", first))[0] == 200
    second = {**first, "messages": turn("b")}
    status, _, headers = await cluster.post(
        "/v1/chat/completions", second, headers={"x-session-affinity": "k2"}
    )
    assert status == 200 and headers["x-kvgate-route"] != "session"  # k2 is a new session; k1 is not asked


async def test_a_key_no_header_could_carry_is_a_session_of_its_own(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 4})
    for key in ("user 42 / chat 3", "agent-ä", "x" * 300):
        requests: list[tuple[str, dict[str, Any]]] = [
            ("/v1/chat/completions", {"messages": turn("a" + key[:3])}),
            ("/v1/chat/completions", {"messages": turn("b" + key[:3])}),
            ("/v1/completions", {"prompt": turn("c" + key[:3])[0]["content"]}),  # (completions honour it too)
        ]
        engines, routes = set(), []
        for path, prompt in requests:
            body = {"model": MODEL, "max_tokens": 2, "prompt_cache_key": key, **prompt}
            status, answer, headers = await cluster.post(path, body)
            assert status == 200, answer
            engines.add(headers["x-kvgate-engine"])
            routes.append(headers["x-kvgate-route"])
        assert len(engines) == 1 and routes[1:] == ["session", "session"], (key, routes)


async def test_a_prompt_cache_key_that_is_no_string_is_refused(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1})
    for key in (7, ["a"], {"a": 1}, True):
        status, answer, _ = await cluster.post(
            "/v1/chat/completions", {"model": MODEL, "messages": turn("a"), "prompt_cache_key": key}
        )
        assert status == 400 and answer["error"]["param"] == "prompt_cache_key", answer


def test_a_key_with_a_space_never_names_another_binding() -> None:
    # Stored responses are bound under "response <id>" beside sessions: a key is never taken as such a name.
    named = session_id(None, {"prompt_cache_key": "response resp_1"}, 256)
    assert named is not None and not named.startswith("response ")
    assert session_id(None, {"prompt_cache_key": "response resp_1"}, 256) == named  # (the same key each time)
    assert session_id(None, {"prompt_cache_key": ""}, 256) is None
    assert session_id(None, {}, 256) is None
    with pytest.raises(InvalidRequest):
        session_id("has space", {}, 256)
