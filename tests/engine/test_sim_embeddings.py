"""The simulated engine's ``POST /v1/embeddings`` through the OpenAI SDK: pseudo-embeddings that are
deterministic per input, normalised, with kvgate's engine's validation and answer shape, prompt tokens
counted as its completions count them, and the cost of a prefill in both of its timing modes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import openai
import pytest

from engine.sim.embeddings import EMBEDDING_DIM
from tests.engine.sim_nodes import Sim, StartSim

Client = Callable[..., Awaitable[tuple[Sim, openai.AsyncOpenAI]]]


@pytest.fixture
async def sim_client(start_sim: StartSim) -> AsyncIterator[Client]:
    clients: list[openai.AsyncOpenAI] = []

    async def make(**overrides: Any) -> tuple[Sim, openai.AsyncOpenAI]:
        sim = await start_sim(**overrides)
        client = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
        clients.append(client)
        return sim, client

    yield make
    for client in clients:
        await client.close()


async def test_pseudo_embeddings_are_deterministic_normalised_and_shaped_as_the_engines(
    sim_client: Client,
) -> None:
    sim, client = await sim_client()
    model = sim.engine.config.model
    one = await client.embeddings.create(model=model, input="hello world")  # base64, decoded by the SDK
    again = await client.embeddings.create(
        model=model, input=["hello world", "other"], encoding_format="float"
    )
    assert one.object == "list" and one.model == model and one.data[0].object == "embedding"
    vector = np.array(one.data[0].embedding)
    assert vector.shape == (EMBEDDING_DIM,) and abs(np.linalg.norm(vector) - 1.0) < 1e-5
    np.testing.assert_allclose(again.data[0].embedding, vector, atol=1e-7)
    assert [item.index for item in again.data] == [0, 1]
    assert not np.allclose(again.data[1].embedding, vector)
    # Its text and its token ids are one input: the same vector.
    ids = sim.engine.tokenizer.encode("hello world").tolist()
    by_ids = await client.embeddings.create(model=model, input=[ids], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, vector, atol=1e-7)


async def test_usage_counts_the_prompt_tokens_its_completions_count(sim_client: Client) -> None:
    sim, client = await sim_client()
    model = sim.engine.config.model
    texts = ["the quick brown fox", "héllo"]
    answer = await client.embeddings.create(model=model, input=texts)
    counted = [(await sim.complete({"prompt": t, "max_tokens": 1}))["usage"]["prompt_tokens"] for t in texts]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(counted)
    ids = await client.embeddings.create(model=model, input=[[1, 2, 3], [4]])
    assert ids.usage.prompt_tokens == 4
    assert sim.engine.counters.embedding_requests == 2
    assert sim.engine.counters.embedding_prompt_tokens == sum(counted) + 4


async def test_a_conversation_is_embedded_as_its_chat_completion_prompt_without_a_generation_prompt(
    sim_client: Client,
) -> None:
    # The simulator shares kvgate's engine's parsing: vLLM's chat forms were a 400 here too.
    sim, _ = await sim_client()
    model = sim.engine.config.model
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is kv?"}]
    chat = await sim.chat(
        {"model": model, "messages": conversation, "add_generation_prompt": False, "max_tokens": 1}
    )
    tokens = chat["usage"]["prompt_tokens"]
    status, one, _ = await sim.post(
        "/v1/embeddings", {"model": model, "messages": conversation, "encoding_format": "float"}
    )
    assert status == 200, one
    assert one["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    status, two, _ = await sim.post(
        "/v1/embeddings", {"model": model, "input": [conversation, conversation], "encoding_format": "float"}
    )
    assert status == 200 and two["usage"]["prompt_tokens"] == 2 * tokens
    assert [item["index"] for item in two["data"]] == [0, 1]
    for item in two["data"]:
        np.testing.assert_allclose(item["embedding"], one["data"][0]["embedding"], atol=1e-7)


async def test_the_simulator_refuses_what_kvgates_engine_refuses(sim_client: Client) -> None:
    sim, client = await sim_client(max_model_len=16)
    model = sim.engine.config.model

    async def refused(**kwargs: Any) -> dict[str, Any]:
        with pytest.raises(openai.BadRequestError) as error:
            await client.embeddings.create(**{"model": model, **kwargs})
        assert isinstance(error.value.body, dict)
        return error.value.body

    assert (await refused(input=""))["param"] == "input"
    assert (await refused(input=[]))["param"] == "input"
    assert (await refused(input="x", encoding_format="bytes"))["param"] == "encoding_format"
    dimensions = await refused(input="x", dimensions=8)
    assert (
        dimensions["param"] == "dimensions"
        and "does not support Matryoshka embeddings" in dimensions["message"]
    )
    too_long = await refused(input=[1] * 17)
    assert too_long["param"] == "input" and too_long["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as missing:
        await client.embeddings.create(model="gpt-17", input="x")
    assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "model_not_found"


async def test_an_embedding_costs_its_prefill_per_request(sim_client: Client) -> None:
    sim, client = await sim_client(prefill_s_per_token=0.01)
    started = time.monotonic()
    await client.embeddings.create(model=sim.engine.config.model, input=[[1] * 10, [2] * 10])
    assert time.monotonic() - started >= 0.2
    assert sim.engine.counters.busy["prefill"].seconds >= 0.2
    assert sim.engine.slots.running == 0  # its slot is given back


async def test_an_embedding_is_a_prefill_in_the_batching_step_loop(sim_client: Client) -> None:
    sim, client = await sim_client(profile="llama3-8b-h100")
    answer = await client.embeddings.create(model=sim.engine.config.model, input=[[1] * 300, [2] * 200])
    assert answer.usage.prompt_tokens == 500
    batching = sim.engine.batching
    assert batching is not None
    assert sum(step.record.prefill_tokens for step in batching.steps) == 500
    assert batching.running == 0 and batching.waiting == 0
