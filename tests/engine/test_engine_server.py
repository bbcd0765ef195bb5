"""The real engine over HTTP: OpenAI API, usage with cached tokens, health, KV events, aborts, failures."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest

from engine.server import EngineServer
from tests.engine.released import assert_released
from tests.engine.served_engine import served_engine


class Running:
    def __init__(self, server: EngineServer, url: str, session: aiohttp.ClientSession) -> None:
        self.server, self.url, self.session = server, url, session

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body) as r:
            return r.status, await r.json(content_type=None)


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Running]:
    async with served_engine(tiny_model_dir, block_size=4, num_kv_blocks=512) as (server, url, session):
        yield Running(server, url, session)


def model_name(served: Running) -> str:
    return served.server.model


async def test_completions_and_chat(served: Running) -> None:
    status, body = await served.post(
        "/v1/completions", {"model": model_name(served), "prompt": "hello", "max_tokens": 4}
    )
    assert status == 200, body
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in ("length", "stop")
    assert (
        body["usage"]["completion_tokens"] <= 4 and "cached_tokens" in body["usage"]["prompt_tokens_details"]
    )
    chat = {"model": model_name(served), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, body = await served.post("/v1/chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


async def test_streaming_chat_with_usage(served: Running) -> None:
    chat = {
        "model": model_name(served),
        "messages": [{"role": "user", "content": "stream me"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    async with served.session.post(served.url + "/v1/chat/completions", json=chat) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


async def test_prompt_token_ids_and_cache_salt(served: Running) -> None:
    ids = list(range(1, 30))
    body = {"model": model_name(served), "prompt": "ignored", "prompt_token_ids": ids, "max_tokens": 2}
    status, first = await served.post("/v1/completions", body)
    assert status == 200 and first["usage"]["prompt_tokens"] == len(ids)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, second = await served.post("/v1/completions", body)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 28  # 7 full blocks of 4
    _, salted = await served.post("/v1/completions", {**body, "cache_salt": "tenant-b"})
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_health_and_kv_events(served: Running) -> None:
    async with served.session.get(served.url + "/health") as r:
        health = await r.json()
    assert r.status == 200 and health["status"] == "ok" and health["simulated"] is False
    assert health["block_size"] == 4 and health["model"] == model_name(served)
    assert {"running", "waiting", "kv_blocks_used", "kv_blocks_free", "max_running"} <= set(health["load"])
    await served.post(
        "/v1/completions",
        {"model": model_name(served), "prompt_token_ids": list(range(3, 20)), "prompt": "x", "max_tokens": 1},
    )
    async with served.session.get(served.url + "/v1/kv_snapshot") as r:
        snapshot = msgpack.unpackb(await r.read())
    assert snapshot["block_size"] == 4 and len(snapshot["blocks"]) >= 4 and snapshot["seq"] >= 1


async def test_bad_requests_are_openai_errors(served: Running) -> None:
    status, body = await served.post(
        "/v1/completions", {"model": model_name(served), "prompt": "x", "max_tokens": 10**7}
    )
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = await served.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    status, body = await served.post("/v1/chat/completions", {"model": model_name(served), "messages": "x"})
    assert status == 400 and body["error"]["param"] == "messages"


async def test_a_client_that_leaves_aborts_the_request(served: Running) -> None:
    chat = {
        "model": model_name(served),
        "messages": [{"role": "user", "content": "long"}],
        "max_tokens": 3000,
        "stream": True,
    }
    response = await served.session.post(served.url + "/v1/chat/completions", json=chat)
    await response.content.readany()
    response.close()
    assert served.server.llm is not None
    await assert_released(served.server.llm, served.session, served.url)


async def test_a_failing_engine_turns_health_red_and_fails_cleanly(served: Running) -> None:
    def broken(batch: object) -> object:
        raise RuntimeError("simulated device failure")

    served.server.llm.runner.run = broken  # type: ignore[method-assign,assignment]
    status, body = await served.post(
        "/v1/completions", {"model": model_name(served), "prompt": "x", "max_tokens": 2}
    )
    assert status == 503 and body["error"]["code"] == "engine_failed"
    async with served.session.get(served.url + "/health") as r:
        assert r.status == 503 and (await r.json())["status"] == "error"
