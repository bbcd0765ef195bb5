"""``/v1/embeddings`` through kvgate in front of two REAL vLLM 0.32.0 engines serving the model as an
embedding model (scripts/test-vllm, phase "embed": ``--runner pooling --convert embed``), with the OpenAI
SDK: the gateway admits each request for the tokens vLLM reports (every input form, vLLM's chat forms
included), relays what vLLM answers, and bills it."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest

from tests.client_request import BareRequest
from tests.integration.conftest import VllmFleet, gateway_in_front, until
from tests.integration.test_vllm_fleet import text

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def bodies(model: str) -> list[dict[str, Any]]:
    conversation = [
        {"role": "system", "content": text(9001, 20)},
        {"role": "user", "content": text(9002, 30)},
    ]
    return [
        {"model": model, "input": text(9000, 40)},
        {"model": model, "input": [text(9003, 10), text(9004, 50), "x"]},
        {"model": model, "input": [text(9003, 10)], "add_special_tokens": False},
        {"model": model, "input": [11, 12, 13, 14]},
        {"model": model, "input": [[11, 12], [13, 14, 15]]},
        {"model": model, "input": [text(9005, 60), text(9006, 5)], "truncate_prompt_tokens": 9},
        {"model": model, "messages": conversation},
        {"model": model, "messages": conversation, "add_generation_prompt": True},
        {"model": model, "input": conversation},
        {"model": model, "messages": [conversation, conversation[1:]]},
    ]


async def test_the_gateway_counts_every_input_form_as_vllm_does(vllm_fleet: VllmFleet) -> None:
    async with gateway_in_front(vllm_fleet) as (url, gateway):
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        direct = openai.AsyncOpenAI(base_url=vllm_fleet.urls[0] + "/v1", api_key="unused", max_retries=0)
        through = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for body in bodies(vllm_fleet.model):
            answer = await direct.post(
                "/embeddings", body={**body, "encoding_format": "float"}, cast_to=object
            )
            assert isinstance(answer, dict) and "usage" in answer, (body, answer)
            p = await gateway.prepare.embeddings(BareRequest(), body)
            assert p.prompt_tokens == answer["usage"]["prompt_tokens"], body
            relayed = await through.post(
                "/embeddings", body={**body, "encoding_format": "float"}, cast_to=object
            )
            assert isinstance(relayed, dict) and relayed["usage"]["prompt_tokens"] == p.prompt_tokens
            assert len(relayed["data"]) == len(answer["data"])
            for mine, theirs in zip(relayed["data"], answer["data"], strict=True):
                assert np.allclose(mine["embedding"], theirs["embedding"], atol=1e-5)
        await direct.close()
        await through.close()


async def test_the_sdk_gets_vllms_embeddings_through_the_gateway_and_they_are_billed(
    vllm_fleet: VllmFleet,
) -> None:
    async with gateway_in_front(vllm_fleet) as (url, gateway):
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        texts = [text(9100, 30), text(9101, 8)]
        raw = await client.embeddings.with_raw_response.create(model=vllm_fleet.model, input=texts)
        answer = raw.parse()  # (base64, the SDK's default, decoded by the SDK)
        floats = await client.embeddings.create(model=vllm_fleet.model, input=texts, encoding_format="float")
        assert [d.index for d in answer.data] == [0, 1]
        for a, b in zip(answer.data, floats.data, strict=True):
            assert np.allclose(a.embedding, b.embedding, atol=1e-6)
            assert abs(np.linalg.norm(a.embedding) - 1.0) < 1e-3
        assert raw.headers["x-kvgate-engine"] in {e.id for e in gateway.fleet}
        await gateway.billing.writer.flush()
        records = [
            r for r in await gateway.billing.ledger.records() if r.request_id == raw.headers["x-request-id"]
        ]
        assert [(r.status, r.prompt_tokens, r.completion_tokens) for r in records] == [
            ("completed", answer.usage.prompt_tokens, 0)
        ]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.embeddings.create(
                model=vllm_fleet.model,
                input="x",
                encoding_format="bytes",  # type: ignore[arg-type]
            )
        assert refused.value.param == "encoding_format"  # type: ignore[attr-defined]
        await client.close()


async def test_salted_embeddings_are_taken_by_vllm(vllm_fleet: VllmFleet) -> None:
    """vLLM's pooling requests take ``cache_salt`` under the same rule as its completions (at most 128
    characters, no '@', '/', '\\' or NUL): a client's salt of any form reaches it as a salt it accepts."""
    async with gateway_in_front(vllm_fleet) as (url, gateway):
        await until(lambda: all(e.healthy for e in gateway.fleet), 30, "engines healthy")
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        unsalted = await client.embeddings.create(model=vllm_fleet.model, input=text(9200, 20))
        for salt in ("alice", "bob@example.com", "x" * 200):
            salted = await client.embeddings.create(
                model=vllm_fleet.model, input=text(9200, 20), extra_body={"cache_salt": salt}
            )
            assert salted.usage.prompt_tokens == unsalted.usage.prompt_tokens
            assert np.allclose(salted.data[0].embedding, unsalted.data[0].embedding, atol=1e-5)
        await client.close()
