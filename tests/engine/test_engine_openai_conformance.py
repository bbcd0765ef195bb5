"""kvgate's engine as a client of vLLM sees it: the official openai SDK against ``kvgate engine`` serving a
tiny random model, as operators do when they point clients straight at an engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest

from cache.tokens import pack_token_ids
from tests.engine_process import engine_process

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    """``kvgate engine`` in a process of its own, on a free port, until the module's tests are done."""
    with engine_process(tiny_model_dir, kv_blocks=64, max_model_len=MAX_MODEL_LEN) as url:
        yield url


@pytest.fixture
def client(engine_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def served_model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_retrieve_finds_the_served_model_and_refuses_others_as_openai_does(
    client: openai.OpenAI,
) -> None:
    # GET /v1/models/{model} had no route: models.retrieve raised NotFoundError for the model the engine
    # serves, with aiohttp's text "404: Not Found" as its body.
    model = served_model(client)
    found = client.models.retrieve(model)
    assert found.id == model and found.object == "model" and found.owned_by == "kvgate"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-17")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"
    assert "gpt-17" in missing.value.message


def test_unknown_paths_and_methods_get_openai_shaped_errors(client: openai.OpenAI) -> None:
    # aiohttp's own "404: Not Found" / "405: Method Not Allowed" in text/plain reached the SDK as an error
    # whose body was a string: no message, type or code to read.
    with pytest.raises(openai.NotFoundError) as missing:
        client.get("/v2/nothing", cast_to=object)
    assert isinstance(missing.value.body, dict) and missing.value.body["type"] == "invalid_request_error"
    assert missing.value.body["code"] == "not_found"
    with pytest.raises(openai.APIStatusError) as wrong:
        client.get("/chat/completions", cast_to=object)
    assert wrong.value.status_code == 405 and wrong.value.response.headers["allow"] == "POST"
    assert isinstance(wrong.value.body, dict) and wrong.value.body["code"] == "method_not_allowed"


def test_a_token_id_outside_the_vocabulary_is_refused_as_the_prompts_fault(client: openai.OpenAI) -> None:
    # The engine refused it as context_length_exceeded without a param: a client told to shorten a 1-token
    # prompt.
    model = served_model(client)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[5, 10**6], max_tokens=2)
    assert refused.value.body == {
        "message": "prompt holds token id 1000000, outside the model's vocabulary of 512",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": None,
    }
    # Through the gateway, which sends the client's prompt packed (prompt_token_ids_hex): the error names the
    # client's own field (it named prompt_token_ids_hex, a field the client never sent).
    packed = {"prompt_token_ids_hex": pack_token_ids(np.array([5, 10**6], dtype=np.uint32))}
    hi = [{"role": "user", "content": "hi"}]
    for field, create in (
        (
            "prompt",
            lambda: client.completions.create(model=model, prompt=[5], max_tokens=2, extra_body=packed),
        ),
        ("messages", lambda: client.chat.completions.create(model=model, messages=hi, extra_body=packed)),
    ):
        with pytest.raises(openai.BadRequestError) as through:
            create()
        assert isinstance(through.value.body, dict) and through.value.body["param"] == field
        assert through.value.body["message"].startswith(f"{field} holds token id 1000000")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_a_prompt_longer_than_the_context_is_refused_naming_the_prompt_and_the_lengths(
    client: openai.OpenAI, kind: str
) -> None:
    # As vLLM: a 400 that names the lengths. The param said max_tokens even when the prompt alone is past the
    # context, where no max_tokens can help.
    model = served_model(client)
    with pytest.raises(openai.BadRequestError) as refused:
        if kind == "chat":
            words = [{"role": "user", "content": "hello world " * 60}]
            client.chat.completions.create(model=model, messages=words, max_completion_tokens=2)
        else:
            client.completions.create(model=model, prompt=[5] * 100, max_tokens=2)
    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded"
    assert body["param"] == ("messages" if kind == "chat" else "prompt")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in body["message"]
    assert "in the prompt" in body["message"]
    with pytest.raises(openai.BadRequestError) as too_much:  # a prompt that fits, asking for too much
        client.completions.create(model=model, prompt=[5] * 40, max_tokens=40)
    assert isinstance(too_much.value.body, dict) and too_much.value.body["param"] == "max_tokens"
    assert "80 tokens (40 in the prompt, 40 for the completion)" in too_much.value.body["message"]


def test_completions_whole_and_streamed_as_the_sdk_reads_them(client: openai.OpenAI) -> None:
    """What was probed and found right, kept so: usage, include_usage, n, logprobs, stop, seed,
    max_completion_tokens and x-request-id, through the SDK's own parsing."""
    model = served_model(client)
    hello = [{"role": "user", "content": "hello"}]
    mine = {"x-request-id": "client-7"}
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=hello,
        max_completion_tokens=3,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_headers=mine,
    )
    chat = raw.parse()
    assert raw.request_id == "client-7" and [c.index for c in chat.choices] == [0, 1]
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    assert all(c.logprobs and len(c.logprobs.content or []) == 3 for c in chat.choices)
    seeded = [
        client.completions.create(model=model, prompt="hello", max_tokens=5, seed=11, temperature=1.0)
        for _ in range(2)
    ]
    assert seeded[0].choices[0].text == seeded[1].choices[0].text
    whole = client.completions.create(model=model, prompt="hello", max_tokens=20, temperature=0, stop=[" "])
    chunks = list(
        client.completions.create(
            model=model, prompt="hello", max_tokens=20, temperature=0, stop=[" "], stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    usage, expected = chunks[-1].usage, whole.usage
    assert chunks[-1].choices == [] and usage is not None and expected is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        expected.prompt_tokens,
        expected.completion_tokens,
    )
    with pytest.raises(openai.BadRequestError) as invalid:
        client.chat.completions.create(model=model, messages=hello, temperature=7, extra_headers=mine)
    assert invalid.value.request_id == "client-7" and invalid.value.body["param"] == "temperature"  # type: ignore[index]


def test_a_completion_of_several_prompts_is_answered_as_vllm_answers_it(client: openai.OpenAI) -> None:
    # The engine answered prompt=["a", "b"], and lists of token-id lists, with a 400 ("only one prompt per
    # request is supported"); vLLM serves a request per prompt and joins the answers.
    model = served_model(client)
    prompts = ["hello", "the quick brown fox"]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=3, temperature=0) for p in prompts]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=3, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage is not None and all(s.usage is not None for s in singles)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles if s.usage)
    assert batch.usage.completion_tokens == 2 * 2 * 3
    chunks = list(
        client.completions.create(
            model=model, prompt=[[5, 6, 7], [8, 9]], max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert {ch.index for c in chunks for ch in c.choices} == {0, 1}
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 5
    with pytest.raises(openai.BadRequestError) as empty:
        client.completions.create(model=model, prompt=[], max_tokens=2)
    assert isinstance(empty.value.body, dict) and empty.value.body["param"] == "prompt"
