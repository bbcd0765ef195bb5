"""Responses bodies read into the chat they generate (no model): the conversation that a
``previous_response_id`` continues, the output budget as vLLM sets it, the fields errors name; and the LRU
the responses are kept in."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cache.chat_template import render_chat
from cache.tokens import ByteTokenizer
from engine.openai_errors import OpenAIError
from engine.responses_request import ResponsesRequest, parse_responses_request
from engine.responses_store import ResponseStore, StoredResponse

TOK = ByteTokenizer()


def parse(body: dict[str, Any], store: ResponseStore | None = None, **kwargs: Any) -> ResponsesRequest:
    history = (store or ResponseStore()).get
    return parse_responses_request(
        orjson.dumps(body), served_model="m", tokenizer=TOK, history=history, **kwargs
    )


def error_of(body: dict[str, Any], **kwargs: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        parse(body, **kwargs)
    return info.value


def prompt_of(req: ResponsesRequest) -> str:
    return bytes(req.gen.prompt_token_ids.tolist()).decode()


def stored(messages: list[dict[str, Any]], *texts: str) -> StoredResponse:
    parts: list[dict[str, Any]] = [
        {"type": "output_text", "text": t, "annotations": [], "logprobs": None} for t in texts
    ]
    item = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": parts}
    return StoredResponse({"id": "resp_1", "output": [item]}, messages)


def test_instructions_and_a_string_input_are_a_system_and_a_user_message() -> None:
    req = parse({"input": "hi", "instructions": "be brief"})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert prompt_of(req) == render_chat(req.messages)
    assert req.id.startswith("resp_") and req.gen.kind == "chat"
    assert (req.store, req.stream, req.logprobs) == (True, False, False)


def test_message_items_are_rendered_with_their_text_parts() -> None:
    """vLLM: text parts joined with newlines, an assistant message's first part only."""
    req = parse(
        {
            "input": [
                {"type": "message", "role": "developer", "content": "d"},
                {
                    "role": "user",
                    "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            ]
        }
    )
    as_chat = [{"role": "developer", "content": "d"}, {"role": "user", "content": "a\nb"}]
    assert prompt_of(req) == render_chat([*as_chat, {"role": "assistant", "content": "c"}])


def test_a_continuation_puts_the_stored_chat_and_output_between_instructions_and_input() -> None:
    """vLLM's construct_input_messages: the new instructions first, the stored messages without their
    system message, one assistant message per output text part, the new input."""
    store = ResponseStore()
    old = [{"role": "system", "content": "old rules"}, {"role": "user", "content": "q1"}]
    store.put("resp_1", stored(old, "a1", "a2"))
    req = parse({"input": "q2", "instructions": "new rules", "previous_response_id": "resp_1"}, store)
    assert req.messages == [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "assistant", "content": "a2"},
        {"role": "user", "content": "q2"},
    ]
    assert prompt_of(req) == render_chat(req.messages)
    # The gateway's ids can only be of the input: the stored conversation is this engine's alone.
    with_ids = parse({"input": "q2", "previous_response_id": "resp_1", "prompt_token_ids": [1, 2]}, store)
    assert prompt_of(with_ids) == render_chat(with_ids.messages) and with_ids.messages[0]["content"] == "q1"


def test_the_budget_is_max_output_tokens_cut_to_what_the_context_leaves() -> None:
    prompt = len(render_chat([{"role": "user", "content": "hi"}]).encode())
    assert parse({"input": "hi", "max_output_tokens": 5}, max_model_len=100).gen.max_tokens == 5
    assert parse({"input": "hi", "max_output_tokens": 500}, max_model_len=100).gen.max_tokens == 100 - prompt
    assert parse({"input": "hi"}, max_model_len=100).gen.max_tokens == 100 - prompt
    assert parse({"input": "hi"}).gen.max_tokens == 16  # (no known context: the chat default)
    err = error_of({"input": "hi"}, max_model_len=prompt)
    assert (err.status, err.param, err.code) == (400, "input", "context_length_exceeded")
    assert (
        err.message
        == f"The engine prompt length {prompt} exceeds the max_model_len {prompt}. Please reduce prompt."
    )


def test_sampling_and_logprobs_are_read_as_a_chats() -> None:
    body = {"input": "x", "temperature": 0.5, "top_p": 0.9, "seed": 3, "stop": ["z"], "cache_salt": "s"}
    req = parse({**body, "include": ["message.output_text.logprobs"], "top_logprobs": 2})
    params = req.gen.params
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.5, 0.9, 3, ("z",))
    assert req.gen.cache_salt == "s" and req.logprobs and params.logprobs == 2
    assert parse({"input": "x", "top_logprobs": 2}).gen.params.logprobs is None  # (vLLM: no include, none)
    assert parse({"input": "x", "include": ["reasoning.encrypted_content"]}).logprobs is False


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "model": "other"}, 404, "model"),
        ({"input": "x", "previous_response_id": "resp_gone"}, 404, "response_id"),
        ({}, 400, "input"),
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, 400, "input"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "e"}]}, 400, "input"),
        ({"input": "x", "instructions": ["a"]}, 400, "instructions"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, 400, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format"),
        ({"input": "x", "prompt": {"id": "p"}}, 400, "prompt"),
        ({"input": "x", "conversation": "conv_1"}, 400, "conversation"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": "x", "store": "yes"}, 400, "store"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "top_logprobs": 21}, 400, "top_logprobs"),
        ({"input": "x", "include": ["file_search_call.everything"]}, 400, "include"),
        ({"input": "x", "structured_outputs": {"regex": "a"}}, 400, "structured_outputs"),
        ({"input": "x", "chat_template_kwargs": 5}, 400, "chat_template_kwargs"),
    ],
)
def test_refusals_name_the_responses_field(body: dict[str, Any], status: int, param: str) -> None:
    err = error_of(body)
    assert (err.status, err.param) == (status, param)


def test_the_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(name, stored([]))
    assert store.get("a") is not None  # now b is the least recently used
    store.put("c", stored([]))
    assert (store.get("a") is not None, store.get("b"), store.get("c") is not None, len(store)) == (
        True,
        None,
        True,
        2,
    )
    assert store.delete("a") and not store.delete("a") and len(store) == 1
    nothing = ResponseStore(0)
    nothing.put("a", stored([]))
    assert nothing.get("a") is None and len(nothing) == 0
