"""Reading a completion that names several prompts into a request per prompt (engine.completion_batch),
without a model: what each prompt's request holds, which bodies stay one request, and the bound."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cache.tokens import ByteTokenizer
from engine.completion_batch import parse_requests
from engine.openai_api import GenerationRequest, RequestKind
from engine.openai_errors import OpenAIError
from engine.openai_sampling import FULL

TOK = ByteTokenizer()


def parse(body: dict[str, Any], kind: RequestKind = "completion", **kwargs: Any) -> list[GenerationRequest]:
    raw = orjson.dumps({"model": "m", **body})
    return parse_requests(
        raw, kind, served_model="m", tokenizer=TOK, request_id="r", capabilities=FULL, **kwargs
    )


def test_each_prompt_is_a_request_named_after_its_index_sharing_the_batchs_id() -> None:
    reqs = parse({"prompt": ["ab", "cde", "f"], "max_tokens": 3, "n": 2, "seed": 5})
    assert [r.request_id for r in reqs] == ["r-0", "r-1", "r-2"]
    assert [r.prompt_token_ids.tolist() for r in reqs] == [list(b"ab"), list(b"cde"), list(b"f")]
    assert len({r.response_id for r in reqs}) == 1 and len({r.created for r in reqs}) == 1
    assert all(r.n == 2 and r.max_tokens == 3 and r.seed == 5 for r in reqs)
    ids = parse({"prompt": [[1, 2], [3]]})
    assert [r.prompt_token_ids.tolist() for r in ids] == [[1, 2], [3]]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "one"},
        {"prompt": ["one"]},
        {"prompt": [[1, 2]]},
        {"prompt": [1, 2, 3]},
        {"prompt": ["a", "b"], "prompt_token_ids": [4, 5]},  # (the gateway's tokenized prompt wins)
    ],
)
def test_a_body_of_one_prompt_is_one_request_as_before(body: dict[str, Any]) -> None:
    reqs = parse(body)
    assert len(reqs) == 1 and reqs[0].request_id == "r"


def test_a_chat_is_never_split() -> None:
    reqs = parse({"messages": [{"role": "user", "content": "hi"}], "prompt": ["a", "b"]}, "chat")
    assert len(reqs) == 1 and reqs[0].kind == "chat"


def test_the_number_of_prompts_is_bounded() -> None:
    assert len(parse({"prompt": ["a"] * 4}, max_prompts=4)) == 4
    with pytest.raises(OpenAIError) as refused:
        parse({"prompt": ["a"] * 5}, max_prompts=4)
    assert refused.value.param == "prompt" and "5 prompts" in refused.value.message
    assert "at most 4" in refused.value.message


def test_a_prompts_context_overflow_names_the_prompt() -> None:
    with pytest.raises(OpenAIError) as refused:
        parse({"prompt": ["a", "b" * 20], "max_tokens": 5}, max_model_len=16)
    error = refused.value
    assert error.code == "context_length_exceeded" and error.message.startswith("prompt 1: ")


def test_the_sequences_a_batch_makes_are_bounded() -> None:
    # 128 prompts at n = 128 made 16,384 sequences, each with its own copy of its prompt, from one request.
    assert len(parse({"prompt": ["a"] * 128, "n": 8})) == 128  # (1024 sequences)
    with pytest.raises(OpenAIError) as refused:
        parse({"prompt": ["a"] * 128, "n": 9})
    assert refused.value.param == "n" and "1152 sequences" in refused.value.message
