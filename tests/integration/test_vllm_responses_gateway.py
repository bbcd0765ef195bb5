"""The Responses API through kvgate in front of two REAL vLLM 0.32.0 engines (scripts/test-vllm: CPU build,
``VLLM_ENABLE_RESPONSES_API_STORE=1``), with the OpenAI SDK: the prompt the gateway renders for a Responses
request is as long as vLLM's (its ``input_tokens``), its cached tokens are predicted as vLLM reports them, and
a conversation continued by ``previous_response_id`` and requests about a stored response reach the engine
that keeps it (any other answers 404)."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.client_request import BareRequest
from tests.integration.conftest import VllmFleet, gateway_in_front, settled, until
from tests.integration.test_vllm_fleet import text

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
]  # fmt: skip


def bodies(model: str) -> list[dict[str, Any]]:
    """Responses requests of the shapes agents send: instructions, message items with parts, tools, a tool
    call and its output, a reasoning item, an earlier answer."""
    history: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text(8101, 40)}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "18C, sunny"},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "It is 18C.", "annotations": []}]},
        {"role": "user", "content": "and tomorrow?"},
    ]  # fmt: skip
    return [
        {"model": model, "input": text(8100, 60)},
        {"model": model, "input": text(8100, 60), "instructions": text(8102, 30)},
        {"model": model, "input": history, "instructions": text(8102, 30), "tools": TOOLS},
        {"model": model, "input": [{"role": "developer", "content": "be brief"}, *history]},
    ]


async def test_the_gateway_renders_responses_requests_as_long_as_vllm_does(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet, engine_options={"tools": True}) as (_, gateway):
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = openai.AsyncOpenAI(base_url=vllm_fleet.urls[0] + "/v1", api_key="unused", max_retries=0)
        for body in bodies(vllm_fleet.model):
            answer = await client.post("/responses", body={**body, "max_output_tokens": 1}, cast_to=object)
            assert isinstance(answer, dict), answer
            p = await gateway.prepare.responses(BareRequest(), body)
            assert len(p.token_ids) == answer["usage"]["input_tokens"], body
        await client.close()


async def test_responses_are_predicted_and_continued_where_they_are_kept(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet) as (url, gateway), aiohttp.ClientSession() as session:
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for turn in range(2):  # (the same long instructions: the second finds them cached, as predicted)
            await settled(gateway)
            raw = await client.responses.with_raw_response.create(
                model=vllm_fleet.model,
                instructions=text(8200, 150),
                input=f"question {turn}",
                max_output_tokens=2,
            )
            response = raw.parse()
            assert response.usage is not None
            cached = response.usage.input_tokens_details.cached_tokens
            assert int(raw.headers["x-kvgate-predicted-cached-tokens"]) == cached
            assert (cached > 0) == (turn == 1)
        # A conversation by previous_response_id: each turn on the engine that keeps the last.
        first = await client.responses.create(
            model=vllm_fleet.model, input=text(8300, 50), max_output_tokens=4
        )
        previous, engines = first.id, set()
        for turn in range(4):
            raw = await client.responses.with_raw_response.create(
                model=vllm_fleet.model,
                input=f"go on {turn}",
                previous_response_id=previous,
                max_output_tokens=4,
            )
            engines.add(raw.headers["x-kvgate-engine"])
            previous = raw.parse().id
        assert len(engines) == 1
        got = await client.responses.retrieve(previous)
        assert got.id == previous and got.status in ("completed", "incomplete")  # (cut at 4 tokens)
        # The other engine does not know it: only the gateway's binding made every turn above work.
        other = next(e.url for e in gateway.fleet if e.id not in engines)
        async with session.get(f"{other}/v1/responses/{previous}") as r:
            assert r.status == 404
        await client.close()
