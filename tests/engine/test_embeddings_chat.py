"""The chat forms of ``/v1/embeddings`` (engine.embedding_chat, through engine.embeddings_api's parsing, which
kvgate's engine and the simulator share), as vLLM 0.32 takes them: ``messages`` or ``input`` holding one
conversation or an array of them, each rendered by the model's chat template without a generation prompt
and without the tokenizer's special tokens unless asked for. Before, all of them were a 400 ("chat messages
are not embedded by this engine")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from cache.tokens import Tokenizer, load_tokenizer
from engine.embeddings_api import EmbeddingRequest, parse_embedding_request
from engine.openai_errors import OpenAIError
from tests.models import with_bos

MAX_MODEL_LEN = 64
QUESTION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is kv?"}]
OTHER = [{"role": "user", "content": [{"type": "text", "text": "two"}, {"type": "text", "text": "parts"}]}]
# The tiny model's template (engine.make_model.CHAT_TEMPLATE), written out.
QUESTION_TEXT = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nwhat is kv?<|im_end|>\n"
OTHER_TEXT = "<|im_start|>user\ntwo\nparts<|im_end|>\n"  # (text parts joined with "\n", as vLLM joins them)
GENERATION_PROMPT = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny model's tokenizer and chat template, with a BOS added to a text as Llama's tokenizer adds
    one: what add_special_tokens would add."""
    loaded = load_tokenizer(str(with_bos(tiny_model_dir, tmp_path_factory.mktemp("chat-bos") / "tiny")))
    assert loaded.chat_template is not None
    return loaded


def parse(tokenizer: Tokenizer, **body: Any) -> EmbeddingRequest:
    return parse_embedding_request(
        orjson.dumps({"model": "m", **body}),
        served_model="m",
        tokenizer=tokenizer,
        request_id="r",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=512,
    )


def refused(tokenizer: Tokenizer, **body: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        parse(tokenizer, **body)
    assert error.value.status == 400
    return error.value


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    out: list[int] = tokenizer.encode(text).tolist()
    return out


def test_a_conversation_is_its_template_rendering_without_a_generation_prompt_or_special_tokens(
    tokenizer: Tokenizer,
) -> None:
    expected = ids(tokenizer, QUESTION_TEXT)
    for body in ({"messages": QUESTION}, {"input": QUESTION}):
        req = parse(tokenizer, **body)
        assert [x.tolist() for x in req.inputs] == [expected]
        assert req.prompt_tokens == len(expected)
    # A text gets the BOS; a conversation does not unless asked for (vLLM: false by default for chats).
    bos = tokenizer.with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    assert bos and parse(tokenizer, input=QUESTION_TEXT).inputs[0].tolist() == bos + expected
    special = parse(tokenizer, messages=QUESTION, add_special_tokens=True)
    assert special.inputs[0].tolist() == bos + expected


def test_arrays_of_conversations_are_one_input_each_in_order(tokenizer: Tokenizer) -> None:
    expected = [ids(tokenizer, QUESTION_TEXT), ids(tokenizer, OTHER_TEXT)]
    for body in ({"messages": [QUESTION, OTHER]}, {"input": [QUESTION, OTHER]}):
        req = parse(tokenizer, **body)
        assert [x.tolist() for x in req.inputs] == expected
        assert req.prompt_tokens == sum(map(len, expected))
    assert [x.tolist() for x in parse(tokenizer, input=[OTHER]).inputs] == expected[1:]


def test_the_template_options_vllm_takes(tokenizer: Tokenizer) -> None:
    prompted = parse(tokenizer, messages=QUESTION, add_generation_prompt=True)
    assert prompted.inputs[0].tolist() == ids(tokenizer, QUESTION_TEXT + GENERATION_PROMPT)
    # The final message left open, as transformers cuts it: no end-of-message marker after it.
    continued = parse(tokenizer, messages=QUESTION, continue_final_message=True)
    assert continued.inputs[0].tolist() == ids(tokenizer, QUESTION_TEXT.removesuffix("<|im_end|>\n"))
    kwargs = parse(tokenizer, messages=QUESTION, chat_template_kwargs={"enable_thinking": False})
    assert kwargs.inputs[0].tolist() == ids(tokenizer, QUESTION_TEXT)
    # Truncated as any input is, after rendering.
    kept = parse(tokenizer, messages=QUESTION, truncate_prompt_tokens=3, truncation_side="left")
    assert kept.inputs[0].tolist() == ids(tokenizer, QUESTION_TEXT)[-3:]


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": "x", "messages": QUESTION}, "messages", "not both"),
        ({"messages": []}, "messages", "non-empty array"),
        ({"messages": "hi"}, "messages", "non-empty array"),
        ({"messages": [QUESTION, "b"]}, "messages", "array of conversations"),
        ({"input": [QUESTION, "b"]}, "input", "array of conversations"),
        ({"input": [QUESTION, []]}, "input", "input[1] must be a non-empty array of messages"),
        ({"messages": [{"content": "no role"}]}, "messages", "messages[0].role"),
        ({"input": [QUESTION, [{"role": 3}]]}, "input", "input[1][0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages", "content"),
        ({"messages": QUESTION, "add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message", "Cannot set both"),
        ({"messages": QUESTION, "add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
        ({"messages": QUESTION, "add_special_tokens": 1}, "add_special_tokens", "boolean"),
        ({"messages": QUESTION, "chat_template_kwargs": []}, "chat_template_kwargs", "object"),
        ({"messages": QUESTION, "chat_template": "{{ messages }}"}, "chat_template", "chat_template"),
        ({"messages": [{"role": "user", "content": "hi " * 80}]}, "messages", "maximum context length"),
    ],
    ids=["both", "empty", "string", "mixed-messages", "mixed-input", "empty-conversation", "no-role",
         "bad-role", "bad-content", "prompt-and-continue", "bad-flag", "bad-special", "bad-kwargs",
         "template", "too-long"],
)  # fmt: skip
def test_a_bad_conversation_is_a_400_naming_its_field(
    tokenizer: Tokenizer, body: dict[str, Any], param: str, says: str
) -> None:
    error = refused(tokenizer, **body)
    assert error.param == param and says in error.message, (error.param, error.message)
