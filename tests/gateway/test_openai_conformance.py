"""What the official openai SDK sees of the gateway: the answers and errors it parses, the headers it
reads."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import ThirdPartyFleet


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
    assert raised.value.message == "Error code: 400 - " + str(raised.value.body["message"])  # type: ignore[index]
