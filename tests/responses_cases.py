"""Responses API requests (``POST /v1/responses`` bodies) that agents send, for the tests of
cache.responses_input: the unit tests hold what vLLM 0.32 makes of each (tests/cache/test_responses_input.py),
tests/integration/test_vllm_responses.py asks vLLM itself. Plain data: vLLM's own Python reads it too."""

from __future__ import annotations

from typing import Any

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOLS: list[dict[str, Any]] = [
    WEATHER,
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}},
     "strict": True, "x-vendor": 1},  # (no description; a key vLLM does not know)
    {"type": "web_search"},  # (a built-in tool: not shown to the model)
    {"type": "custom", "name": "shell", "description": "Run a shell command"},
    {"type": "namespace", "name": "crm", "description": "The CRM",
     "tools": [{"type": "function", "name": "find", "parameters": {"type": "object"}, "defer_loading": True},
               {"type": "custom", "name": "note"}]},
]  # fmt: skip


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said(text: str, **more: Any) -> dict[str, Any]:
    """An assistant's output message, as the Responses API returns it and agents send it back."""
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "role": "assistant",
        "id": "msg_1",
        "status": "completed",
        "content": [part],
    } | more


def call(call_id: str, name: str, arguments: str, **more: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments} | more


def output(call_id: str, result: Any) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": result}


def reasoning(text: str | None = None, summary: str | None = None, **more: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "reasoning", "summary": []}
    if summary is not None:
        item["summary"] = [{"type": "summary_text", "text": summary}]
    if text is not None:
        item["content"] = [{"type": "reasoning_text", "text": text}]
    return item | more


# name -> (body, history, previous_output): a stateless request, or one continuing a stored response.
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]] | None, list[dict[str, Any]] | None]] = {
    "string input": ({"input": "What is the capital of France?"}, None, None),
    "instructions": ({"instructions": "You are terse.", "input": "Hi"}, None, None),
    "message items": (
        {"instructions": "Be brief.", "input": [
            {"role": "system", "content": "Answer in French."},
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "No emoji."}]},
            user("first"),
            {"role": "user", "name": "bob",
             "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
            {"role": "assistant", "content": "plain reply"},
            {"role": "user", "content": "again"},
        ]},
        None, None,
    ),
    "function tools and calls": (
        {"tools": TOOLS, "input": [
            user("Weather in Paris, and note it"),
            call("c1", "get_weather", '{"city": "Paris"}'),
            call("c2", "find", '{"q": "Paris"}', namespace="crm", id="fc_2", status="completed"),
            output("c1", "18C"),
            output("c2", [{"type": "input_text", "text": "row 1"}, {"type": "input_text", "text": "row 2"}]),
            said("It is 18C."),
            user("And now?"),
        ]},
        None, None,
    ),
    "reasoning items": (
        {"tools": [WEATHER], "input": [
            user("Weather?"),
            reasoning("I need the weather tool.", summary="Calls a tool"),
            call("c1", "get_weather", "{not json"),
            output("c1", "sunny"),
            reasoning(summary="Only a summary"),
            said("Sunny."),
            reasoning(),
            said("Anything else?"),
            {"role": "assistant", "content": "merged into nothing: a message of its own"},
            user("No"),
        ]},
        None, None,
    ),
    "output message then reasoning and calls": (
        {"tools": [WEATHER], "input": [
            user("Go"),
            said("Checking.", content=[{"type": "output_text", "text": "Checking.", "annotations": []},
                                       {"type": "output_text", "text": "(vLLM reads only the first part)"}]),
            reasoning("think"),
            call("c1", "get_weather", '{"city": "Oslo"}'),
            call("c2", "get_weather", '{"city": "Rome"}'),
            output("c1", "cold"),
            output("c2", "warm"),
            {"role": "assistant", "content": [{"type": "input_text", "text": "as input text"}]},
        ]},
        None, None,
    ),
    "a partial final assistant message": (
        {"input": [user("Count to three"), said("One, two,", status="incomplete")]}, None, None
    ),
    "a partial final reasoning item": (
        {"input": [user("Think"), reasoning("Let me", status="in_progress")]}, None, None
    ),
    "reasoning effort and template kwargs": (
        {"input": "Hi", "reasoning": {"effort": "low", "summary": "auto"},
         "chat_template_kwargs": {"style": "terse", "add_generation_prompt": False}},
        None, None,
    ),
    "reasoning effort none": ({"input": "Hi", "reasoning": {"effort": "none"}}, None, None),
    "thinking set by the client wins": (
        {"input": "Hi", "reasoning": {"effort": "high"}, "chat_template_kwargs": {"enable_thinking": False}},
        None, None,
    ),
    "custom tool calls": (
        {"tools": TOOLS[3:4], "tool_choice": {"type": "custom", "name": "shell"}, "input": [
            user("List files"),
            {"type": "custom_tool_call", "call_id": "s1", "name": "shell", "input": "ls -l \u00e9"},
            {"type": "custom_tool_call_output", "call_id": "s1", "output": "a.txt"},
        ]},
        None, None,
    ),
    "tool choice named by a namespaced function's own name": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "name": "find"}, "input": "find Paris"},
        None, None,
    ),
    "only built-in tools": ({"tools": [{"type": "web_search"}], "input": "search"}, None, None),
    "tools with tool_choice none": ({"tools": [WEATHER], "tool_choice": "none", "input": "Hi"}, None, None),
    "a continued response": (
        {"instructions": "New instructions.", "input": [call("c9", "get_weather", "{}"), output("c9", "ok")]},
        [{"role": "system", "content": "Old instructions."}, {"role": "user", "content": "Weather?"}],
        [{"type": "reasoning", "id": "rs_1", "summary": []},
         {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
          "content": [{"type": "output_text", "text": "Let me look.", "annotations": []},
                      {"type": "output_text", "text": "One moment.", "annotations": []}]}],
    ),
    "empty input": ({"instructions": "Only this.", "input": []}, None, None),
    "an assistant message without text takes the calls after it": (
        {"input": [user("a"), {"role": "assistant", "content": []}, call("c1", "get_weather", "{}"),
                   output("c1", "warm")]},
        None, None,
    ),
    "a partial assistant message of a string": (
        {"input": [user("Count"), {"type": "message", "role": "assistant", "content": "One,",
                                   "status": "in_progress"}]},
        None, None,
    ),
}  # fmt: skip

# name -> (body, the field vLLM names in its 400)
REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "encrypted reasoning": ({"input": [user("a"), reasoning(encrypted_content="gAAAA")]}, "input"),
    "an item reference": ({"input": [user("a"), {"type": "item_reference", "id": "msg_0"}]}, "input"),
    "a built-in tool's call": (
        {"input": [user("a"), {"type": "web_search_call", "id": "ws_1", "status": "completed",
                               "action": {"type": "search", "query": "q"}}]},
        "input",
    ),
    "a function call without its call_id": ({"input": [user("a"), {"type": "function_call", "name": "f",
                                                                   "arguments": "{}"}]}, "input"),
    "a reasoning item without its summary": (
        {"input": [user("a"), {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "x"}]}]},
        "input",
    ),
    "a tool message": ({"input": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "input"),
    "an output part in a user message": (
        {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input"
    ),
    "no input": ({"instructions": "x"}, "input"),
    "tool_choice required without tools": ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    "tool_choice naming no tool": (
        {"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"
    ),
    "a custom tool with a grammar": (
        {"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
            "type": "grammar", "syntax": "lark", "definition": "start: 'a'"}}]},
        "tools",
    ),
    "a prompt template": ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    "an unknown reasoning effort": ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
}  # fmt: skip
# What vLLM takes but the gateway refuses (vLLM's answer: an internal error, or media the gateway does not
# render): name -> (body, the field named).
REFUSED_HERE: dict[str, tuple[dict[str, Any], str]] = {
    "an image": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input",
    ),
    "an output message opening with a refusal": (
        {"input": [user("a"), {"type": "message", "role": "assistant",
                               "content": [{"type": "refusal", "refusal": "no"}]}]},
        "input",
    ),
    "an empty output message": (
        {"input": [user("a"), {"type": "message", "role": "assistant", "content": []}]}, "input"
    ),
}  # fmt: skip
