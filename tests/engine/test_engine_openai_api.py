"""Request parsing and response formatting shared by kvgate engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache.chat_template import render_chat
from cache.tokens import ByteTokenizer, load_tokenizer, pack_token_ids
from engine.openai_api import GenerationRequest, parse_request
from engine.openai_errors import OpenAIError
from engine.openai_format import SseFormatter, response_body, usage
from tests.models import make_bos_tokenizer_dir

TOK = ByteTokenizer()


def parse(body: dict[str, Any], kind: str = "completion", **kwargs: Any) -> GenerationRequest:
    return parse_request(orjson.dumps(body), kind, served_model="m", tokenizer=TOK, **kwargs)  # type: ignore[arg-type]


def error_of(body: dict[str, Any] | bytes, kind: str = "completion", **kwargs: Any) -> OpenAIError:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    with pytest.raises(OpenAIError) as info:
        parse_request(raw, kind, served_model="m", tokenizer=TOK, **kwargs)  # type: ignore[arg-type]
    return info.value


def test_completion_defaults() -> None:
    req = parse({"model": "m", "prompt": "hey"})
    assert req.kind == "completion"
    assert req.prompt_token_ids.dtype == np.uint32
    assert req.prompt_token_ids.tolist() == list(b"hey")
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (16, (), False, False)
    assert (req.seed, req.temperature, req.top_p, req.top_k, req.cache_salt) == (None, 1.0, 1.0, 0, "")
    assert req.model == "m"
    assert req.response_id.startswith("cmpl-") and len(req.request_id) == 32
    assert req.prompt_tokens == 3


def test_all_fields() -> None:
    req = parse(
        {
            "prompt": "hey",
            "max_tokens": 5,
            "stop": ["a", "", "b"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": -4,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 40,
            "cache_salt": "t1",
            "n": 1,
            "user": "ignored",
        },
        request_id="rid",
    )
    assert (req.max_tokens, req.stop, req.stream, req.include_usage) == (5, ("a", "b"), True, True)
    assert (req.seed, req.temperature, req.top_p, req.top_k, req.cache_salt) == (-4, 0.0, 0.5, 40, "t1")
    assert req.request_id == "rid"


def test_include_usage_needs_stream() -> None:
    assert parse({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage is False


@pytest.mark.parametrize(
    "prompt",
    [[104, 105], ["hi"], [[104, 105]]],
)
def test_completion_prompt_forms(prompt: Any) -> None:
    assert parse({"prompt": prompt}).prompt_token_ids.tolist() == [104, 105]


def test_prompt_token_ids_win_over_prompt_and_messages() -> None:
    assert parse({"prompt": "abc", "prompt_token_ids": [7, 8]}).prompt_token_ids.tolist() == [7, 8]
    chat = parse({"messages": [{"role": "user", "content": "x"}], "prompt_token_ids": [2**32 - 1]}, "chat")
    assert chat.prompt_token_ids.tolist() == [2**32 - 1]


def test_chat_renders_messages() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    req = parse({"messages": messages, "max_tokens": 3, "max_completion_tokens": 9}, "chat")
    assert req.kind == "chat" and req.response_id.startswith("chatcmpl-")
    assert req.prompt_token_ids.tolist() == list(render_chat(messages).encode())
    assert req.max_tokens == 9  # the newer name wins


CHAT_WITH_PARTS_AND_A_DEVELOPER = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "developer", "content": "in French"},
]
# vLLM: text parts joined with "\n"; a developer message (the template names no such role) becomes system,
# merged into the first (vllm/renderers/chat_utils.py, vllm/renderers/hf.py).
AS_VLLM_RENDERS_IT = (
    "<|im_start|>system\nbe brief\n\nin French<|im_end|>\n"
    "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n"
)


def test_a_chat_is_rendered_as_vllm_renders_it() -> None:
    req = parse({"messages": CHAT_WITH_PARTS_AND_A_DEVELOPER}, "chat")
    assert req.prompt_token_ids.tolist() == list(AS_VLLM_RENDERS_IT.encode())


def test_packed_token_ids_win_over_every_other_prompt() -> None:
    ids = np.array([0, 7, 2**32 - 1, 151_643], dtype=np.uint32)
    packed = pack_token_ids(ids)
    assert packed == "0000000000000007ffffffff0002505b"
    body = {"prompt": "abc", "prompt_token_ids": [1, 2], "prompt_token_ids_hex": packed}
    assert parse(body).prompt_token_ids.tolist() == ids.tolist()
    chat = parse({"messages": [{"role": "user", "content": "x"}], "prompt_token_ids_hex": packed}, "chat")
    assert chat.prompt_token_ids.dtype == np.uint32 and chat.prompt_token_ids.tolist() == ids.tolist()


@pytest.mark.parametrize(
    ("value", "fragment", "param"),
    [
        (7, "string of hex digits", "prompt_token_ids_hex"),
        ("0000000g", "only hex digits", "prompt_token_ids_hex"),
        ("000001", "8 hex digits", "prompt_token_ids_hex"),
        ("", "empty", "prompt"),  # (a well-formed packing of the client's empty prompt: the client's field)
    ],
)
def test_packed_token_id_errors(value: Any, fragment: str, param: str) -> None:
    err = error_of({"prompt": "x", "prompt_token_ids_hex": value})
    assert (err.status, err.param) == (400, param)
    assert fragment in err.message


@given(st.lists(st.integers(-(2**40), 2**40) | st.booleans(), min_size=1, max_size=40))
def test_token_ids_parse_as_numpy_would(ids: list[int]) -> None:
    # The C-level parse must accept and refuse exactly what checking the numpy array did.
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        assert "integers" in error_of({"prompt_token_ids": ids}).message
    elif arr.min() < 0 or arr.max() >= 2**32:
        assert "2**32" in error_of({"prompt_token_ids": ids}).message
    else:
        parsed = parse({"prompt_token_ids": ids}).prompt_token_ids
        assert parsed.dtype == np.uint32 and parsed.tolist() == arr.tolist()


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"prompt": ["a", "b"]}, "prompt", "only one prompt per request is supported"),
        ({"prompt": [[1], [2]]}, "prompt", "only one prompt"),
        ({"prompt": []}, "prompt", "empty"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [1.5]}, "prompt", "array of token ids"),
        ({"prompt": [1, 1.5]}, "prompt", "integers"),
        ({"prompt": [2**32]}, "prompt", "2**32"),
        ({"prompt_token_ids": [[1, 2]]}, "prompt_token_ids", "integers"),
        ({"prompt_token_ids": []}, "prompt_token_ids", "empty"),
        ({"prompt_token_ids": [True, False]}, "prompt_token_ids", "integers"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
        ({"prompt": "x", "n": True}, "n", "n=1"),
        ({"prompt": "x", "best_of": 2}, "best_of", "best_of"),
        ({"prompt": "x", "echo": True}, "echo", "echo"),
        ({"prompt": "x", "logprobs": 2}, "logprobs", "logprobs"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k", "top_k"),
        ({"prompt": "x", "seed": "1"}, "seed", "seed"),
        ({"prompt": "x", "stop": [1]}, "stop", "stop"),
        ({"prompt": "x", "stream_options": True}, "stream_options", "object"),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "",
        ),
        ({"prompt": "x", "model": 3}, "model", "string"),
    ],
)
def test_client_errors(body: dict[str, Any], param: str, fragment: str) -> None:
    err = error_of(body)
    assert (err.status, err.param, err.error_type) == (400, param, "invalid_request_error")
    assert fragment in err.message


def test_context_length() -> None:
    assert parse({"prompt": "abcd", "max_tokens": 6}, max_model_len=10).max_tokens == 6
    err = error_of({"prompt": "abcd", "max_tokens": 7}, max_model_len=10)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "max_tokens")


def test_a_chat_without_a_limit_may_fill_the_context_a_completion_stops_at_16() -> None:
    messages = [{"role": "user", "content": "hello there"}]
    chat = parse({"messages": messages}, "chat", max_model_len=1000)
    assert chat.max_tokens == 1000 - chat.prompt_tokens
    limited = parse({"messages": messages, "max_completion_tokens": 5}, "chat", max_model_len=1000)
    assert limited.max_tokens == 5
    assert parse({"prompt": "hello there"}, max_model_len=1000).max_tokens == 16
    assert parse({"messages": messages}, "chat").max_tokens == 16  # no known context: the completion default
    # A prompt that fills the context is still refused, and blamed on the prompt.
    err = error_of({"messages": messages}, "chat", max_model_len=chat.prompt_tokens)
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")


def test_unknown_model_and_bad_json() -> None:
    err = error_of({"model": "other", "prompt": "x"})
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert error_of(b"\xff\xfe").status == 400
    assert error_of(b"null").status == 400
    assert orjson.loads(error_of(b"{").body()) == {
        "error": {
            "message": "the request body is not valid JSON",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def test_chat_message_errors() -> None:
    assert error_of({"messages": [1]}, "chat").param == "messages[0]"
    assert error_of({"messages": [{"role": ""}]}, "chat").param == "messages[0].role"
    assert error_of({"prompt": "x"}, "chat").param == "messages"


def test_response_bodies() -> None:
    u = usage(10, 3, 8)
    assert u == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    comp = orjson.loads(response_body(parse({"prompt": "x"}), "abc", "length", u))
    assert comp["object"] == "text_completion"
    assert comp["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}]
    assert comp["usage"] == u
    chat = orjson.loads(response_body(parse({"messages": [{"role": "user"}]}, "chat"), "hi", "stop", u))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert chat["choices"][0]["finish_reason"] == "stop"


def sse_payloads(data: bytes) -> list[Any]:
    text = data.decode()
    assert text.endswith("\n\n")
    out = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: ")
        body = block[6:]
        out.append(body if body == "[DONE]" else orjson.loads(body))
    return out


def test_sse_chunks_quote_text_safely() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}], "stream": True}, "chat")
    fmt = SseFormatter(req)
    tricky = 'a"\\\n\u00e9'
    [start, tok] = sse_payloads(fmt.start() + fmt.token(tricky))
    assert start["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert tok["choices"][0]["delta"] == {"content": tricky}
    assert tok["id"] == req.response_id and tok["created"] == req.created and tok["model"] == "m"
    final, done = sse_payloads(fmt.finish("length", usage(1, 1, 0)))
    assert final["choices"][0]["finish_reason"] == "length" and "usage" not in final
    assert done == "[DONE]"


def test_sse_completion_chunks_with_usage() -> None:
    req = parse({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    fmt = SseFormatter(req)
    assert fmt.start() == b""
    [tok] = sse_payloads(fmt.token("z"))
    assert tok["object"] == "text_completion" and tok["choices"][0]["text"] == "z"
    final, usage_chunk, done = sse_payloads(fmt.finish("stop", usage(1, 1, 0)))
    assert final["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 2
    assert done == "[DONE]"


def test_a_completions_text_gets_the_special_tokens_its_tokenizer_adds_as_in_vllm(tmp_path: Path) -> None:
    # vLLM's add_special_tokens: true by default for completions (Llama's BOS), false for chats; ids as sent.
    tok = load_tokenizer(make_bos_tokenizer_dir(tmp_path / "bos"))
    bos = tok.with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    text = "hello world"

    def ids(body: dict[str, Any], kind: str = "completion") -> list[int]:
        raw = orjson.dumps({"model": "m", **body})
        return parse_request(raw, kind, served_model="m", tokenizer=tok).prompt_token_ids.tolist()  # type: ignore[arg-type]

    plain = tok.encode(text).tolist()
    assert ids({"prompt": text}) == ids({"prompt": [text]}) == bos + plain
    assert ids({"prompt": text, "add_special_tokens": False}) == plain
    assert ids({"prompt": plain}) == plain  # token ids are the prompt as they are
    chat = {"messages": [{"role": "user", "content": text}]}
    assert ids(chat, "chat")[: len(bos)] != bos
    assert ids({**chat, "add_special_tokens": True}, "chat")[: len(bos)] == bos
