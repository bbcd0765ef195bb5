"""A Responses API request (POST /v1/responses) as the chat body vLLM 0.32 renders it as
(cache.responses_input): the messages and template inputs the chat template is then given.

The expected values are vLLM's own, for the requests of tests/responses_cases.py: its
construct_input_messages / construct_tool_dicts (entrypoints/openai/responses/utils.py), then its chat
parsing (renderers/chat_utils.py parse_chat_messages, renderers/hf.py's developer-role conversion) and the
template kwargs of OnlineRenderer.preprocess_chat, for a template that is given strings and does not know the
developer role. They were written out from vLLM 0.32 (tests/integration/vllm_responses_reference.py), and
tests/integration/test_vllm_responses.py checks them against it, with the prompts and token ids it renders.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from cache.chat_dialect import VLLM, ChatContentError
from cache.responses_input import responses_chat_body
from tests.responses_cases import CASES, REFUSED, REFUSED_HERE, WEATHER, call, output, user

_ASIDE = ("tools", "add_generation_prompt", "continue_final_message")


def vllm_view(messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> dict[str, Any]:
    """What a template that is given strings and does not know the developer role sees: the messages and
    the template's other inputs (its kwargs, the variables sorted)."""
    return {
        "messages": messages,
        "tools": kwargs.get("tools"),
        "add_generation_prompt": kwargs["add_generation_prompt"],
        "continue_final_message": kwargs["continue_final_message"],
        "variables": {k: kwargs[k] for k in sorted(kwargs) if k not in _ASIDE},
    }


def ours(body: dict[str, Any], history: Any = None, previous_output: Any = None) -> dict[str, Any]:
    chat = responses_chat_body(body, history, previous_output)
    inputs = VLLM.chat_inputs(chat)
    messages = VLLM.messages(chat["messages"], "string", names_developer=False)
    kwargs = {"tools": inputs.tools, "add_generation_prompt": inputs.add_generation_prompt,
              "continue_final_message": inputs.continue_final_message, **inputs.variables}  # fmt: skip
    return vllm_view(messages, kwargs)


CHAT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CHAT_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": None,
        "parameters": {"type": "object", "properties": {}},
        "strict": True,
    },
}
CHAT_SHELL = {
    "type": "function",
    "function": {
        "name": "shell",
        "description": "Run a shell command",
        "parameters": {
            "type": "object",
            "properties": {
                "input": {"type": "string", "description": "The freeform text payload for this tool."}
            },
            "required": ["input"],
            "additionalProperties": False,
        },
    },
}
CHAT_FIND = {
    "type": "function",
    "function": {
        "name": "crm__find",
        "description": None,
        "parameters": {"type": "object"},
        "defer_loading": True,
    },
}
EXPECTED: dict[str, dict[str, Any]] = {
    "string input": {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "instructions": {
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "message items": {
        "messages": [
            {"role": "system", "content": "Be brief.\n\nAnswer in French.\n\nNo emoji."},
            {"role": "user", "content": "first"},
            {"role": "user", "content": "a\nb", "name": "bob"},
            {"role": "assistant", "content": "plain reply"},
            {"role": "user", "content": "again"},
        ],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "function tools and calls": {
        "messages": [
            {"role": "user", "content": "Weather in Paris, and note it"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                        "type": "function",
                    },
                    {
                        "id": "c2",
                        "function": {"name": "crm__find", "arguments": {"q": "Paris"}},
                        "type": "function",
                    },
                ],
            },
            {"role": "tool", "content": "18C", "tool_call_id": "c1"},
            {"role": "tool", "content": "row 1\nrow 2", "tool_call_id": "c2"},
            {"role": "assistant", "content": "It is 18C."},
            {"role": "user", "content": "And now?"},
        ],
        "tools": [CHAT_WEATHER, CHAT_TIME, CHAT_SHELL, CHAT_FIND],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "reasoning items": {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": {}}, "type": "function"}
                ],
                "reasoning": "I need the weather tool.",
                "reasoning_content": "I need the weather tool.",
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
            {
                "role": "assistant",
                "content": "Sunny.",
                "reasoning": "Only a summary",
                "reasoning_content": "Only a summary",
            },
            {"role": "assistant", "content": "Anything else?", "reasoning": "", "reasoning_content": ""},
            {"role": "assistant", "content": "merged into nothing: a message of its own"},
            {"role": "user", "content": "No"},
        ],
        "tools": [CHAT_WEATHER],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "output message then reasoning and calls": {
        "messages": [
            {"role": "user", "content": "Go"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "c1",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                        "type": "function",
                    },
                    {
                        "id": "c2",
                        "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                        "type": "function",
                    },
                ],
                "reasoning": "think",
                "reasoning_content": "think",
            },
            {"role": "tool", "content": "cold", "tool_call_id": "c1"},
            {"role": "tool", "content": "warm", "tool_call_id": "c2"},
            {"role": "assistant", "content": "as input text"},
        ],
        "tools": [CHAT_WEATHER],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "a partial final assistant message": {
        "messages": [
            {"role": "user", "content": "Count to three"},
            {"role": "assistant", "content": "One, two,"},
        ],
        "tools": None,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "variables": {},
    },
    "a partial final reasoning item": {
        "messages": [
            {"role": "user", "content": "Think"},
            {"role": "assistant", "content": "", "reasoning": "Let me", "reasoning_content": "Let me"},
        ],
        "tools": None,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "variables": {},
    },
    "reasoning effort and template kwargs": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {"enable_thinking": True, "reasoning_effort": "low", "style": "terse"},
    },
    "reasoning effort none": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {"enable_thinking": False, "reasoning_effort": "none"},
    },
    "thinking set by the client wins": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {"enable_thinking": False, "reasoning_effort": "high"},
    },
    "custom tool calls": {
        "messages": [
            {"role": "user", "content": "List files"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "s1",
                        "function": {"name": "shell", "arguments": {"input": "ls -l é"}},
                        "type": "function",
                    }
                ],
            },
            {"role": "tool", "content": "a.txt", "tool_call_id": "s1"},
        ],
        "tools": [CHAT_SHELL],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "tool choice named by a namespaced function's own name": {
        "messages": [{"role": "user", "content": "find Paris"}],
        "tools": [CHAT_WEATHER, CHAT_TIME, CHAT_SHELL, CHAT_FIND],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "only built-in tools": {
        "messages": [{"role": "user", "content": "search"}],
        "tools": [],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "tools with tool_choice none": {
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [CHAT_WEATHER],
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "a continued response": {
        "messages": [
            {"role": "system", "content": "New instructions."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "assistant", "content": "One moment."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c9", "function": {"name": "get_weather", "arguments": {}}, "type": "function"}
                ],
            },
            {"role": "tool", "content": "ok", "tool_call_id": "c9"},
        ],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "empty input": {
        "messages": [{"role": "system", "content": "Only this."}],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "an assistant message without text takes the calls after it": {
        "messages": [
            {"role": "user", "content": "a"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": {}}, "type": "function"}
                ],
            },
            {"role": "tool", "content": "warm", "tool_call_id": "c1"},
        ],
        "tools": None,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "variables": {},
    },
    "a partial assistant message of a string": {
        "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "One,"}],
        "tools": None,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "variables": {},
    },
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_responses_request_gives_the_template_what_vllm_gives_it(name: str) -> None:
    body, history, previous_output = CASES[name]
    sent = copy.deepcopy((body, history, previous_output))
    # (Compared as JSON: the order of each message's keys matters to a template that writes it out whole.)
    assert json.dumps(ours(body, history, previous_output)) == json.dumps(EXPECTED[name])
    assert (body, history, previous_output) == sent  # (the request is left as the client sent it)


@pytest.mark.parametrize("name", list(REFUSED) + list(REFUSED_HERE))
def test_what_vllm_refuses_is_refused_naming_the_field(name: str) -> None:
    body, param = {**REFUSED, **REFUSED_HERE}[name]
    with pytest.raises(ChatContentError) as refused:
        responses_chat_body(body)
    assert refused.value.param == param


def test_vllms_messages_for_errors_are_kept() -> None:
    refused: list[tuple[dict[str, Any], str]] = [
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]},
         "Encrypted content is not supported."),
        ({"input": [{"type": "item_reference", "id": "m"}]}, "Unsupported input item type: item_reference"),
        ({"input": "x", "tool_choice": "required"},
         "Tool choice 'required' must be specified with 'tools' parameter."),
    ]  # fmt: skip
    for body, message in refused:
        with pytest.raises(ChatContentError) as raised:
            responses_chat_body(body)
        assert str(raised.value) == message


def test_the_chat_body_carries_tool_choice_as_the_chat_api_writes_it() -> None:
    # vLLM's validation (check_tool_usage): "auto" without tools is "none"; a namespaced function named by
    # its own name is named by its flat name.
    assert responses_chat_body({"input": "x"})["tool_choice"] == "none"
    tools = [{"type": "namespace", "name": "crm", "description": "d", "tools": [WEATHER]}]
    chosen = {"type": "function", "name": "get_weather"}
    chat = responses_chat_body({"input": "x", "tools": tools, "tool_choice": chosen, "model": "m"})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "crm__get_weather"}}
    assert chat["model"] == "m"
    doubled = [*tools, {**tools[0], "name": "erp"}]
    with pytest.raises(ChatContentError, match="ambiguous"):
        responses_chat_body({"input": "x", "tools": doubled, "tool_choice": chosen})


def test_a_function_call_written_out_whole_keeps_vllms_key_order() -> None:
    # vLLM's Responses API builds a tool call {"id", "function": {"name", "arguments"}, "type"} and renders
    # it unvalidated; its chat API's validation writes arguments before name. A template writing the call out
    # with tojson sees the difference.
    chat = responses_chat_body({"input": [user("a"), call("c1", "f", '{"x": 1}'), output("c1", "ok")]})
    calls = VLLM.messages(chat["messages"], "string", names_developer=False)[1]["tool_calls"]
    assert (
        json.dumps(calls)
        == '[{"id": "c1", "function": {"name": "f", "arguments": {"x": 1}}, "type": "function"}]'
    )
