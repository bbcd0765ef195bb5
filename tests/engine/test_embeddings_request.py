"""``/v1/embeddings`` requests and answers (engine.embeddings_api), shared by kvgate's engine and the
simulator: what vLLM 0.32 adds, truncates and refuses, without a model."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from cache.tokens import Tokenizer, load_tokenizer
from engine.embeddings_api import EmbeddingRequest, embeddings_body, parse_embedding_request, pooled
from engine.openai_errors import OpenAIError
from tests.models import make_bos_tokenizer_dir

MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def bos_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return load_tokenizer(make_bos_tokenizer_dir(tmp_path_factory.mktemp("bos") / "tok"))


def parse(tokenizer: Tokenizer, **body: Any) -> EmbeddingRequest:
    raw = orjson.dumps({"model": "m", **body})
    return parse_embedding_request(
        raw,
        served_model="m",
        tokenizer=tokenizer,
        request_id="r",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=400,
    )


def refused(tokenizer: Tokenizer, **body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        parse(tokenizer, **body)
    return error.value


def test_a_text_gets_the_tokenizers_special_tokens_unless_asked_not_to_and_ids_are_taken_as_sent(
    bos_tokenizer: Tokenizer,
) -> None:
    # vLLM's add_special_tokens is true by default for the completion-like input forms: Llama's BOS.
    bos = bos_tokenizer.with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    assert bos
    plain = bos_tokenizer.encode("hello world").tolist()
    texts = parse(bos_tokenizer, input=["hello world", "the lazy dog"])
    assert texts.inputs[0].tolist() == bos + plain
    assert texts.prompt_tokens == 2 * len(bos) + len(plain) + len(bos_tokenizer.encode("the lazy dog"))
    assert parse(bos_tokenizer, input="hello world", add_special_tokens=False).inputs[0].tolist() == plain
    assert parse(bos_tokenizer, input=plain).inputs[0].tolist() == plain
    assert [ids.tolist() for ids in parse(bos_tokenizer, input=[plain, [5]]).inputs] == [plain, [5]]


def test_truncation_keeps_the_first_n_tokens_by_default_and_the_last_n_on_the_left(
    bos_tokenizer: Tokenizer,
) -> None:
    ids = list(range(10, 50))  # 40 tokens: past the 32-token context
    assert parse(bos_tokenizer, input=ids, truncate_prompt_tokens=4).inputs[0].tolist() == ids[:4]
    left = parse(bos_tokenizer, input=ids, truncate_prompt_tokens=4, truncation_side="left")
    assert left.inputs[0].tolist() == ids[-4:]
    assert parse(bos_tokenizer, input=ids, truncate_prompt_tokens=-1).prompt_tokens == MAX_MODEL_LEN
    assert parse(bos_tokenizer, input=ids[:3], truncate_prompt_tokens=10).inputs[0].tolist() == ids[:3]
    bos = bos_tokenizer.with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    kept = parse(bos_tokenizer, input="hello world hello", truncate_prompt_tokens=2).inputs[0].tolist()
    assert kept[: len(bos)] == bos and len(kept) == 2  # truncated after the special tokens are added
    assert refused(bos_tokenizer, input=ids).param == "input"
    assert refused(bos_tokenizer, input=ids, truncate_prompt_tokens=0).param == "input"
    assert refused(bos_tokenizer, input=ids, truncate_prompt_tokens=-2).param == "truncate_prompt_tokens"
    assert refused(bos_tokenizer, input=ids, truncation_side="middle").param == "truncation_side"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "cache_salt": ""}, "cache_salt"),
        ({"input": "x", "cache_salt": "a/b"}, "cache_salt"),
        ({"input": "x", "cache_salt": "s" * 129}, "cache_salt"),
        ({"input": "x", "user": 5}, "user"),
        ({"input": "x", "priority": 1}, "priority"),
        ({"input": "x", "padding": "max_length"}, "padding"),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype"),
        ({"input": "x", "endianness": "middle"}, "endianness"),
        ({"input": "x", "dimensions": "8"}, "dimensions"),
        ({"input": "x", "use_activation": "yes"}, "use_activation"),
        ({"input": "x", "add_special_tokens": 1}, "add_special_tokens"),
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [[1], "a"]}, "input"),
        ({"input": [[{"role": "user", "content": "hi"}], "a"]}, "input"),
        ({}, "input"),
    ],
)
def test_what_vllm_refuses_is_a_400_naming_its_field(
    bos_tokenizer: Tokenizer, body: dict[str, Any], param: str
) -> None:
    error = refused(bos_tokenizer, **body)
    assert error.status == 400 and error.param == param


def test_what_vllm_takes_and_changes_nothing_here_is_accepted(bos_tokenizer: Tokenizer) -> None:
    req = parse(
        bos_tokenizer,
        input="x",
        user="u",
        cache_salt="tenant-a",
        priority=0,
        padding="do_not_pad",
        embed_dtype="float32",
        request_id="abc",
        some_future_field=1,
    )
    assert req.cache_salt == "tenant-a" and req.response_id.startswith("embd-")


def test_the_answer_is_normalised_and_base64_is_the_float32_bytes(bos_tokenizer: Tokenizer) -> None:
    vectors = [np.array([3.0, 4.0], dtype=np.float32), np.zeros(2, dtype=np.float32)]
    req = parse(bos_tokenizer, input=[[1, 2], [3]])
    body = orjson.loads(embeddings_body(req, vectors))
    assert body["object"] == "list" and body["model"] == "m" and body["id"] == req.response_id
    assert body["data"] == [
        {"index": 0, "object": "embedding", "embedding": [0.6, 0.8]},
        {"index": 1, "object": "embedding", "embedding": [0.0, 0.0]},  # (a zero vector stays zero)
    ]
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    b64 = orjson.loads(
        embeddings_body(parse(bos_tokenizer, input=[1], encoding_format="base64"), vectors[:1])
    )
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert np.frombuffer(raw, dtype="<f4").tolist() == pooled(vectors[0], True).tolist()
    unnormalised = parse(bos_tokenizer, input=[1], use_activation=False)
    assert orjson.loads(embeddings_body(unnormalised, vectors[:1]))["data"][0]["embedding"] == [3.0, 4.0]


def test_the_tiny_model_tokenizer_adds_nothing(tiny_model_dir: Path) -> None:
    # (The engine tests' text inputs are then their plain ids: transformers is given the same.)
    tok = load_tokenizer(str(tiny_model_dir))
    assert parse(tok, input="hello").inputs[0].tolist() == tok.encode("hello").tolist()
