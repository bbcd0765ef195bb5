"""``POST /v1/embeddings`` on kvgate's engine through the OpenAI SDK, as vLLM 0.32 serves a causal LM run as
an embedding model: the last token's final hidden state, L2-normalised, checked against transformers'
LlamaModel on the same tiny random checkpoint; the input forms, usage, truncation, and the 400s."""

from __future__ import annotations

import base64
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from cache.tokens import load_tokenizer
from tests.engine_process import engine_process

MAX_MODEL_LEN = 64
TEXTS = ["the quick brown fox", "hello world, hello kvgate", "a"]


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path) -> Iterator[str]:
    with engine_process(tiny_model_dir, kv_blocks=64, max_model_len=MAX_MODEL_LEN) as url:
        yield url


@pytest.fixture
def client(engine_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=engine_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """transformers' LlamaModel (no lm_head: its output is the final norm's) on the engine's checkpoint."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaModel.from_pretrained(str(tiny_model_dir)).eval()


def last_hidden(reference: Any, ids: list[int], normalize: bool = True) -> np.ndarray:
    import torch

    with torch.no_grad():
        hidden: np.ndarray = reference(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return hidden / np.linalg.norm(hidden) if normalize else hidden


def ids_of(model_dir: Path, text: str) -> list[int]:
    ids: list[int] = load_tokenizer(str(model_dir)).encode(text).tolist()
    return ids


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def post(engine_url: str, body: dict[str, Any]) -> Any:
    """The 200 body of a /v1/embeddings request, as JSON."""
    raw = json.dumps(body).encode()
    request = urllib.request.Request(engine_url + "/v1/embeddings", raw, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def test_the_sdks_default_call_gets_the_normalised_last_hidden_state_of_transformers(
    client: openai.OpenAI, reference: Any, tiny_model_dir: Path
) -> None:
    # The SDK asks for base64 and decodes it: the embedding is the last token's hidden state after the
    # final norm, normalised (vLLM's LAST pooling for an embed-converted LlamaForCausalLM).
    model = model_of(client)
    answer = client.embeddings.create(model=model, input=TEXTS[1])
    ids = ids_of(tiny_model_dir, TEXTS[1])
    assert answer.object == "list" and answer.model == model and len(answer.data) == 1
    item = answer.data[0]
    assert item.index == 0 and item.object == "embedding"
    got = np.array(item.embedding)
    assert got.shape == (64,)  # the model's hidden size
    np.testing.assert_allclose(got, last_hidden(reference, ids), atol=1e-4)
    assert abs(np.linalg.norm(got) - 1.0) < 1e-5
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == len(ids)


def test_float_and_base64_carry_the_same_float32_values(engine_url: str, client: openai.OpenAI) -> None:
    as_float = client.embeddings.create(model=model_of(client), input="hello", encoding_format="float")
    raw = post(engine_url, {"input": "hello", "encoding_format": "base64"})
    assert raw["id"].startswith("embd-") and isinstance(raw["created"], int)
    assert set(raw["usage"]) == {"prompt_tokens", "total_tokens"}
    encoded = raw["data"][0]["embedding"]
    assert isinstance(encoded, str)  # little-endian float32 bytes
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == np.array(as_float.data[0].embedding, dtype=np.float32).tolist()
    big = post(engine_url, {"input": "hello", "encoding_format": "base64", "endianness": "big"})
    assert (
        np.frombuffer(base64.b64decode(big["data"][0]["embedding"]), dtype=">f4").tolist() == decoded.tolist()
    )


def test_a_list_of_strings_is_one_embedding_per_input_in_order_with_usage_summed(
    client: openai.OpenAI, reference: Any, tiny_model_dir: Path
) -> None:
    answer = client.embeddings.create(model=model_of(client), input=TEXTS)
    assert [item.index for item in answer.data] == [0, 1, 2]
    ids = [ids_of(tiny_model_dir, text) for text in TEXTS]
    for item, prompt in zip(answer.data, ids, strict=True):
        np.testing.assert_allclose(item.embedding, last_hidden(reference, prompt), atol=1e-4)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))


def test_token_ids_and_lists_of_them_embed_those_tokens_as_they_are(
    client: openai.OpenAI, reference: Any, tiny_model_dir: Path
) -> None:
    model = model_of(client)
    text_ids = ids_of(tiny_model_dir, TEXTS[0])
    one = client.embeddings.create(model=model, input=text_ids)
    same_text = client.embeddings.create(model=model, input=TEXTS[0])
    np.testing.assert_allclose(one.data[0].embedding, same_text.data[0].embedding, atol=1e-6)
    prompts = [[5, 6, 7], [300, 2, 9, 11, 40]]
    many = client.embeddings.create(model=model, input=prompts)
    assert [item.index for item in many.data] == [0, 1] and many.usage.prompt_tokens == 8
    for item, prompt in zip(many.data, prompts, strict=True):
        np.testing.assert_allclose(item.embedding, last_hidden(reference, prompt), atol=1e-4)


def test_truncation_keeps_the_first_tokens_unless_told_left_as_vllms_pooling_tokenizers(
    client: openai.OpenAI, reference: Any
) -> None:
    model = model_of(client)
    prompt = list(range(10, 90))  # 80 tokens: past the 64-token context
    first = client.embeddings.create(model=model, input=prompt, extra_body={"truncate_prompt_tokens": 5})
    np.testing.assert_allclose(first.data[0].embedding, last_hidden(reference, prompt[:5]), atol=1e-4)
    assert first.usage.prompt_tokens == 5
    last = client.embeddings.create(
        model=model, input=prompt, extra_body={"truncate_prompt_tokens": 5, "truncation_side": "left"}
    )
    np.testing.assert_allclose(last.data[0].embedding, last_hidden(reference, prompt[-5:]), atol=1e-4)
    whole = client.embeddings.create(model=model, input=prompt, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_MODEL_LEN
    np.testing.assert_allclose(
        whole.data[0].embedding, last_hidden(reference, prompt[:MAX_MODEL_LEN]), atol=1e-4
    )


def test_use_activation_false_leaves_the_hidden_state_unnormalised(engine_url: str, reference: Any) -> None:
    body = {"input": [3, 4, 5, 6], "encoding_format": "float", "use_activation": False}
    raw = np.array(post(engine_url, body)["data"][0]["embedding"])
    np.testing.assert_allclose(raw, last_hidden(reference, [3, 4, 5, 6], normalize=False), atol=1e-4)
    assert abs(np.linalg.norm(raw) - 1.0) > 1e-2


def bad_request(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(**{"model": model_of(client), **kwargs})
    assert isinstance(refused.value.body, dict)
    return refused.value.body


@pytest.mark.parametrize("empty", ["", [], [""], [[]], ["a", ""]])
def test_an_empty_input_is_a_400_naming_input(client: openai.OpenAI, empty: Any) -> None:
    body = bad_request(client, input=empty)
    assert body["param"] == "input" and body["type"] == "invalid_request_error"
    assert "empty" in body["message"]


@pytest.mark.parametrize("encoding", ["bytes", "bytes_only", "hex"])
def test_binary_and_unknown_encoding_formats_are_a_400_naming_encoding_format(
    client: openai.OpenAI, encoding: str
) -> None:
    body = bad_request(client, input="hi", encoding_format=encoding)
    assert body["param"] == "encoding_format"


def test_dimensions_are_refused_with_vllms_message(client: openai.OpenAI) -> None:
    model = model_of(client)
    body = bad_request(client, input="hi", dimensions=32)
    assert body["param"] == "dimensions"
    assert body["message"] == (
        f"Model {model!r} does not support Matryoshka embeddings; dimensions must be unset "
        "(received dimensions=32)."
    )


def test_an_input_longer_than_the_context_is_a_400_naming_input(client: openai.OpenAI) -> None:
    body = bad_request(client, input=[[7] * 3, [7] * (MAX_MODEL_LEN + 1)])
    assert body["param"] == "input" and body["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in body["message"]
    assert f"contains {MAX_MODEL_LEN + 1} input tokens" in body["message"]
    too_far = bad_request(client, input="hi", extra_body={"truncate_prompt_tokens": MAX_MODEL_LEN + 1})
    assert too_far["param"] == "truncate_prompt_tokens"


def test_conversations_embed_their_chat_template_rendering_without_a_generation_prompt(
    engine_url: str, reference: Any, tiny_model_dir: Path
) -> None:
    # vLLM's chat forms (messages, or input, as one conversation or an array of them) were a 400 here.
    question = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is kv?"}]
    other = [{"role": "user", "content": "hello"}]
    rendered = [  # the tiny model's template, written out: no generation prompt, no special tokens
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is kv?<|im_end|>\n",
        "<|im_start|>user\nhello<|im_end|>\n",
    ]
    ids = [ids_of(tiny_model_dir, text) for text in rendered]
    singles: list[dict[str, Any]] = [{"messages": question}, {"input": question}]
    for body in singles:
        answer = post(engine_url, {**body, "encoding_format": "float"})
        assert [item["index"] for item in answer["data"]] == [0]
        np.testing.assert_allclose(answer["data"][0]["embedding"], last_hidden(reference, ids[0]), atol=1e-4)
        assert answer["usage"] == {"prompt_tokens": len(ids[0]), "total_tokens": len(ids[0])}
    batches: list[dict[str, Any]] = [{"messages": [question, other]}, {"input": [question, other]}]
    for body in batches:
        answer = post(engine_url, {**body, "encoding_format": "float"})
        assert [item["index"] for item in answer["data"]] == [0, 1]
        for item, prompt in zip(answer["data"], ids, strict=True):
            np.testing.assert_allclose(item["embedding"], last_hidden(reference, prompt), atol=1e-4)
        assert answer["usage"]["prompt_tokens"] == sum(map(len, ids))
    prompted = post(
        engine_url, {"messages": other, "add_generation_prompt": True, "encoding_format": "float"}
    )
    with_prompt = ids_of(tiny_model_dir, rendered[1] + "<|im_start|>assistant\n")
    np.testing.assert_allclose(
        prompted["data"][0]["embedding"], last_hidden(reference, with_prompt), atol=1e-4
    )


def test_conversations_the_engine_cannot_embed_and_removed_fields_are_refused_clearly(
    client: openai.OpenAI,
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert bad_request(client, input="x", extra_body={"messages": messages})["param"] == "messages"
    assert bad_request(client, input=[messages, "x"])["param"] == "input"
    long = [{"role": "user", "content": "hello world " * 60}]
    too_long = bad_request(client, input=long)
    assert too_long["param"] == "input" and too_long["code"] == "context_length_exceeded"
    assert bad_request(client, input="x", extra_body={"normalize": True})["param"] == "normalize"
    assert bad_request(client, input=[10**6])["param"] == "input"  # outside the vocabulary


def test_an_unknown_model_is_a_404_as_the_other_endpoints_answer(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="gpt-17", input="hi")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "model_not_found" and missing.value.body["param"] == "model"


def test_metrics_count_embedding_requests_and_their_tokens(engine_url: str, client: openai.OpenAI) -> None:
    def counts() -> tuple[float, float]:
        with urllib.request.urlopen(engine_url + "/metrics", timeout=60) as answer:
            text = answer.read().decode()
        values = dict(
            line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("kvgate_engine_embedding")
        )
        return (
            float(values[next(k for k in values if k.startswith("kvgate_engine_embedding_requests_total"))]),
            float(
                values[next(k for k in values if k.startswith("kvgate_engine_embedding_prompt_tokens_total"))]
            ),
        )

    before = counts()
    client.embeddings.create(model=model_of(client), input=[[1, 2, 3], [4, 5]])
    after = counts()
    assert (after[0] - before[0], after[1] - before[1]) == (1.0, 5.0)


def test_an_engine_core_process_embeds_as_the_engine_thread_does(
    tiny_model_dir: Path, reference: Any
) -> None:
    # `kvgate engine` runs its core in a process of its own by default: the prompt crosses to it and back,
    # and so does the core's refusal of one its KV cache (4 blocks of 4 here) could never hold.
    with (
        engine_process(
            tiny_model_dir, kv_blocks=4, max_model_len=MAX_MODEL_LEN, engine_core="process"
        ) as url,
        openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as core,
    ):
        answer = core.embeddings.create(model=model_of(core), input=[[5, 6, 7], [8, 9]])
        refused = bad_request(core, input=[[5, 6], [7] * 17])
    assert refused["param"] == "input" and "need 5 KV blocks; this engine has 4" in refused["message"]
    np.testing.assert_allclose(answer.data[0].embedding, last_hidden(reference, [5, 6, 7]), atol=1e-4)
    np.testing.assert_allclose(answer.data[1].embedding, last_hidden(reference, [8, 9]), atol=1e-4)
    assert answer.usage.prompt_tokens == 5
