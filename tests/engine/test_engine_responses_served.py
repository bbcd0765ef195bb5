"""The Responses API of an engine served in this process, where a test can look inside: a client that leaves
aborts its response, a failed engine fails it cleanly, the store keeps what ``responses_stored`` says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from engine.llm_engine import EngineConfig, LLMEngine
from engine.server import ENGINE_SERVER, EngineServer, ServerConfig, build_app
from tests.serving import serve

Serve = Callable[[int], Awaitable[tuple[EngineServer, str]]]


@pytest.fixture
async def start(tiny_model_dir: Path) -> AsyncIterator[Serve]:
    runners: list[web.AppRunner] = []

    async def start(stored: int) -> tuple[EngineServer, str]:
        engine = LLMEngine(EngineConfig(str(tiny_model_dir), block_size=4, num_kv_blocks=512, device="cpu"))
        app = build_app(engine, ServerConfig(engine_id="test/e0", responses_stored=stored))
        runners.append(web.AppRunner(app, handler_cancellation=True))
        return app[ENGINE_SERVER], await serve(runners[-1])

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_a_client_that_leaves_a_stream_aborts_the_response(start: Serve) -> None:
    server, url = await start(8)
    body = {"input": "long", "max_output_tokens": 3000, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        response = await session.post(url + "/v1/responses", json=body)
        await response.content.readany()
        response.close()
    engine = server.llm
    assert engine is not None
    for _ in range(200):
        if not engine.scheduler.has_work():
            break
        await asyncio.sleep(0.02)
    assert not engine.scheduler.has_work() and engine.blocks.num_free == engine.blocks.num_blocks


@pytest.mark.parametrize("stream", [False, True])
async def test_a_failed_engine_fails_the_response_with_engine_failed(start: Serve, stream: bool) -> None:
    server, url = await start(8)

    def broken(batch: object) -> object:
        raise RuntimeError("simulated device failure")

    assert server.llm is not None
    server.llm.runner.run = broken  # type: ignore[method-assign,union-attr]
    async with aiohttp.ClientSession() as session:
        body = {"input": "x", "max_output_tokens": 2, "stream": stream}
        async with session.post(url + "/v1/responses", json=body) as r:
            assert r.status == 503 and (await r.json())["error"]["code"] == "engine_failed"


async def test_the_store_keeps_the_most_recently_used_responses(start: Serve) -> None:
    _, url = await start(2)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        made = [await client.responses.create(input=f"turn {i}", max_output_tokens=1) for i in range(2)]
        await client.responses.retrieve(made[0].id)  # now made[1] is the least recently used
        await client.responses.create(input="turn 2", max_output_tokens=1)
        assert (await client.responses.retrieve(made[0].id)).id == made[0].id
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made[1].id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(input="on", previous_response_id=made[1].id)
        with pytest.raises(openai.NotFoundError):  # (its input items went with it)
            await client.responses.input_items.list(made[1].id)
        # A streamed response's items are kept as a whole one's are.
        events = [e async for e in await client.responses.create(input="s", max_output_tokens=1, stream=True)]
        streamed = events[-1]
        assert streamed.type == "response.completed"
        (item,) = (await client.responses.input_items.list(streamed.response.id)).data
        assert item.type == "message" and item.content[0].type == "input_text"
        assert item.content[0].text == "s"


async def test_an_engine_that_keeps_no_responses_says_they_are_not_stored(start: Serve) -> None:
    # As vLLM without its store (it sets the request's store to false): --max-stored-responses 0 answered
    # store: true for a response it then did not find, and a gateway bound its id to the engine.
    _, url = await start(0)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        made = await client.responses.create(input="hi", max_output_tokens=1)
        assert made.store is False
        events = [
            e async for e in await client.responses.create(input="hi", max_output_tokens=1, stream=True)
        ]
        assert [e.response.store for e in events if e.type in ("response.created", "response.completed")] == [
            False,
            False,
        ]
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(made.id)
