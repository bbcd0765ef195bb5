"""What the official openai SDK sees of the gateway: the answers and errors it parses, the headers it
reads."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import ThirdPartyFleet
from tests.harness import MODEL, ClusterFactory


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_an_engines_refusal_reaches_the_sdk_as_that_engines_error(
    third_party: ThirdPartyFleet, kind: str
) -> None:
    # vLLM nests its error as OpenAI does; SGLang's ErrorResponse is flat ({"object": "error", "message",
    # ...}). The client must get the engine's message and param either way, not the flat body quoted in a
    # message of the gateway's.
    cluster, _ = await third_party({"eu-west/e0": {"kind": kind, "max_model_len": 64}})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(model="tiny", prompt=[7] * 80, max_tokens=2)
    await client.close()
    assert raised.value.body == {
        "message": "Input length (80) exceeds model's maximum context length (64).",
        "type": "BadRequestError",
        "param": "prompt",
        "code": 400,
    }
    assert raised.value.message == "Error code: 400 - " + str(raised.value.body["message"])


async def test_the_gateways_own_errors_carry_the_request_id(make_cluster: ClusterFactory) -> None:
    # The SDK reads x-request-id into every APIStatusError (exc.request_id): what a client quotes to find its
    # request in the gateway's and the engines' logs. The gateway's own refusals sent none.
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    hello = [{"role": "user", "content": "hello"}]
    mine = {"x-request-id": "client-chosen-1"}
    with pytest.raises(openai.NotFoundError) as not_found:  # refused while preparing
        await client.chat.completions.create(model="gpt-17", messages=hello, extra_headers=mine)
    assert not_found.value.request_id == "client-chosen-1"
    with pytest.raises(openai.BadRequestError) as invalid:  # refused by validation, no id of the client's
        await client.chat.completions.create(model=MODEL, messages=hello, temperature=7)
    assert invalid.value.request_id is not None and invalid.value.request_id.startswith("req-")
    with pytest.raises(openai.BadRequestError) as another:  # each refusal gets an id of its own
        await client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokens": "a lot"})
    assert another.value.request_id not in (None, invalid.value.request_id)
    await cluster.stop_engine("eu-west/e0")  # refused after routing: the id the engine was sent
    with pytest.raises(openai.APIStatusError) as failed:
        await client.chat.completions.create(model=MODEL, messages=hello, extra_headers=mine)
    assert failed.value.status_code in (502, 503) and failed.value.request_id == "client-chosen-1"
    await client.close()


async def test_a_text_part_without_its_text_is_refused_for_what_it_lacks(
    make_cluster: ClusterFactory,
) -> None:
    # It was refused as "content part of type 'text' is not supported; only text is": the client is told the
    # type it used is unsupported, and that the same type is the one supported.
    cluster = await make_cluster({"eu-west": 1})
    client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
    for part in ({"type": "text"}, {"type": "text", "text": None}):
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": [part]}],
            )
        assert raised.value.body == {
            "message": "a content part of type 'text' needs its text, a string",
            "type": "invalid_request_error",
            "param": "messages",
            "code": None,
        }
    with pytest.raises(openai.BadRequestError) as image:
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        )
    assert image.value.message.endswith("content part of type 'image_url' is not supported; only text is")
    await client.close()
