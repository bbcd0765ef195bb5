"""A chat's template inputs besides its messages (tools, tool-call history, chat_template_kwargs,
add_generation_prompt, continue_final_message, documents, reasoning_effort), prepared as vLLM 0.32 prepares
them: the gateway's prompt (what it hashes to route) and kvgate's engine's against transformers'
apply_chat_template given what vLLM hands it, written out here from vLLM's source
(renderers/chat_utils.py, renderers/hf.py, entrypoints/openai/chat_completion/protocol.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from cache.chat_dialect import VLLM
from cache.tokens import HFTokenizer, load_tokenizer
from engine.openai_api import parse_request
from engine.openai_errors import OpenAIError
from engine.responses_request import parse_responses_request
from engine.responses_store import ResponseStore
from gateway.config import GatewaySettings
from gateway.http.errors import InvalidRequest
from gateway.prepare import RequestPreparer
from region_map.config import parse_topology
from region_map.fleet import Fleet
from tests.cache.test_token_cache_tenants import FakeClientRequest
from tests.chat_templates import TOOLS_CHATML
from tests.models import make_bos_tokenizer_dir, make_tokenizer_dir

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {  # no description; a key vLLM does not know (dropped), strict given
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}, "strict": True},
    "x-vendor": 1,
}
# What vLLM gives the template as `tools` (ChatCompletionToolsParam.model_dump()).
VLLM_TOOLS = [
    WEATHER,
    {
        "type": "function",
        "function": {"name": "get_time", "description": None,
                     "parameters": {"type": "object", "properties": {}}, "strict": True},
    },
]  # fmt: skip

CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    {"function": {"arguments": "{not json", "name": "get_time"}, "id": "c2", "type": "function"},
    {"id": "c3", "type": "function", "function": {"name": "get_time", "arguments": "[1, 2]"}},
]
HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?", "reasoning": "dropped: not an assistant's"},
    {"role": "assistant", "content": None, "tool_calls": CALLS, "reasoning_content": "I need tools."},
    {"role": "tool", "content": [{"type": "text", "text": "18C"}, {"type": "text", "text": "sunny"}],
     "tool_call_id": "c1", "name": "get_weather"},
    {"role": "assistant", "content": "Checking the time.", "tool_calls": []},
    {"role": "user", "content": "Thanks", "x-extra": 1},
]  # fmt: skip
# HISTORY as vLLM hands it to the template: arguments parsed (malformed or not an object: {}), keys in
# pydantic's order, reasoning under both names, the tool's text parts joined with "\n", an empty
# tool_calls dropped, keys vLLM does not keep for the role dropped.
VLLM_HISTORY = [
    {"role": "system", "content": "You are a weather bot."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "function": {"arguments": {"city": "Paris"}, "name": "get_weather"}, "type": "function"},
        {"id": "c2", "function": {"arguments": {}, "name": "get_time"}, "type": "function"},
        {"id": "c3", "function": {"arguments": {}, "name": "get_time"}, "type": "function"}],
     "reasoning": "I need tools.", "reasoning_content": "I need tools."},
    {"role": "tool", "content": "18C\nsunny", "tool_call_id": "c1", "name": "get_weather"},
    {"role": "assistant", "content": "Checking the time."},
    {"role": "user", "content": "Thanks"},
]  # fmt: skip
SHORT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]

# (request body fields, what transformers' apply_chat_template is given besides the chat's messages)
CASES: dict[str, tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]] = {
    "tools": ({"messages": SHORT, "tools": [WEATHER, TIME]}, SHORT, {"tools": VLLM_TOOLS}),
    "tool-call history": ({"messages": HISTORY, "tools": [WEATHER]}, VLLM_HISTORY, {"tools": [WEATHER]}),
    "chat_template_kwargs": (
        {"messages": SHORT, "chat_template_kwargs": {"enable_thinking": False, "style": "terse", "x": None}},
        SHORT,
        {"enable_thinking": False, "style": "terse"},
    ),
    "reasoning_effort none turns thinking off": (
        {"messages": SHORT, "reasoning_effort": "none"}, SHORT, {"enable_thinking": False}
    ),
    "the request's field wins over chat_template_kwargs": (
        {"messages": SHORT, "chat_template_kwargs": {"add_generation_prompt": False}}, SHORT, {}
    ),
    "continue_final_message": (
        {"messages": [*SHORT, {"role": "assistant", "content": "Hello! The answer is "}],
         "add_generation_prompt": False, "continue_final_message": True},
        [*SHORT, {"role": "assistant", "content": "Hello! The answer is "}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    # An assistant message of tool calls and no "content" key: its calls were dropped, as if it said nothing.
    "tool calls without content": (
        {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": CALLS[:1]},
                      {"role": "tool", "content": "18C", "tool_call_id": "c1"}]},
        [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "",
                                                   "tool_calls": VLLM_HISTORY[2]["tool_calls"][:1]},
         {"role": "tool", "content": "18C", "tool_call_id": "c1"}],
        {},
    ),
    "no generation prompt": ({"messages": SHORT, "add_generation_prompt": False}, SHORT,
                             {"add_generation_prompt": False}),
    "documents": (
        {"messages": SHORT, "documents": [{"title": "T", "text": "body"}]},
        SHORT,
        {"documents": [{"title": "T", "text": "body"}]},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = make_tokenizer_dir(tmp_path_factory.mktemp("tools") / "m")
    config = {"chat_template": TOOLS_CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def _as_vllm_renders(model_dir: Path, messages: list[dict[str, Any]], given: dict[str, Any]) -> str:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>"
    )
    kwargs = {"add_generation_prompt": True, **given}
    rendered = hf.apply_chat_template(messages, chat_template=TOOLS_CHATML, tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


def _preparer(model_dir: Path) -> tuple[RequestPreparer, HFTokenizer]:
    tok = load_tokenizer(model_dir)
    assert isinstance(tok, HFTokenizer)
    # (The engine is never called: preparing only.)
    engine = {"name": "e", "url": "http://127.0.0.1:9", "model": "m", "kind": "vllm", "tools": True}
    fleet = Fleet(parse_topology({"region": "r", "regions": [{"name": "r", "engines": [engine]}]}))
    return RequestPreparer(GatewaySettings(), fleet, tok), tok


@pytest.mark.parametrize("case", list(CASES))
async def test_the_gateway_renders_tools_and_template_inputs_as_vllm_does(model_dir: Path, case: str) -> None:
    fields, vllm_messages, given = CASES[case]
    prepare, tok = _preparer(model_dir)
    body = {"model": "m", **fields}
    sent = orjson.dumps(body)
    prepared = await prepare.chat(FakeClientRequest(), body)
    expected = tok.encode(_as_vllm_renders(model_dir, vllm_messages, given))
    assert prepared.token_ids.tolist() == expected.tolist()
    assert orjson.dumps(body) == sent  # (the body the engine is sent: left as the client wrote it)


@pytest.mark.parametrize("case", [c for c in CASES if "tools" not in CASES[c][0]])
def test_kvgate_engines_render_template_inputs_as_vllm_does(model_dir: Path, case: str) -> None:
    # (kvgate's engines call no tools, and refuse a request for them; the rest they render as vLLM.)
    fields, vllm_messages, given = CASES[case]
    tok = load_tokenizer(model_dir)
    raw = orjson.dumps({"model": "m", **fields})
    request = parse_request(raw, "chat", served_model="m", tokenizer=tok)  # type: ignore[arg-type]
    expected = tok.encode(_as_vllm_renders(model_dir, vllm_messages, given))
    assert request.prompt_token_ids.tolist() == expected.tolist()


def test_the_vllm_dialect_keeps_what_vllm_keeps_in_its_order() -> None:
    # A template may write a message out whole (`message | tojson`): the keys and their order matter.
    assert VLLM.messages(HISTORY, "string", names_developer=False) == VLLM_HISTORY
    prepared = VLLM.messages(HISTORY, "string", names_developer=False)
    assert [list(m) for m in prepared] == [list(m) for m in VLLM_HISTORY]
    assert [list(c) for c in prepared[2]["tool_calls"]] == [["id", "function", "type"]] * 3
    developer = VLLM.messages([{"role": "developer", "content": "d"}], "string", names_developer=True)
    assert developer == [{"role": "developer", "content": "d", "tools": None}]


def test_claude_codes_billing_header_is_dropped_from_system_prompts_as_vllm_drops_it() -> None:
    header = "x-anthropic-billing-header: cc_version=1; cch=abc123;"
    chat = [
        {
            "role": "system",
            "content": [{"type": "text", "text": header}, {"type": "text", "text": "You are"}],
        },
        {"role": "system", "content": header + "\nBe brief."},
        {"role": "user", "content": header},  # (a user's text is the user's)
    ]
    assert [m["content"] for m in VLLM.messages(chat, "string", names_developer=False)] == [
        "You are",
        "Be brief.",
        header,
    ]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "chat_template_kwargs.chat_template"),
        ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
        ({"continue_final_message": True}, "continue_final_message"),  # (with the default generation prompt)
        ({"documents": ["text"]}, "documents"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "x"}]}]}, "messages"),
    ],
)
async def test_template_inputs_of_the_wrong_shape_are_refused_naming_the_field(
    model_dir: Path, fields: dict[str, Any], param: str
) -> None:
    prepare, _ = _preparer(model_dir)
    body = {"model": "m", "messages": SHORT, **fields}
    with pytest.raises(InvalidRequest) as info:
        await prepare.chat(FakeClientRequest(), body)
    assert info.value.param == param
    if "tools" not in fields:  # (kvgate's engines refuse tools before they look at them)
        with pytest.raises(OpenAIError) as engine_error:
            parse_request(orjson.dumps(body), "chat", served_model="m", tokenizer=load_tokenizer(model_dir))  # type: ignore[arg-type]
        assert engine_error.value.param == param


async def test_a_responses_prompt_gets_the_special_tokens_its_tokenizer_adds_as_vllm_encodes_it(
    tmp_path: Path,
) -> None:
    # vLLM encodes the prompt it renders for a Responses request with add_special_tokens (TokenizeParams'
    # default; a chat's is false): with a BOS-adding tokenizer its input_tokens were one more than the
    # gateway's (261 against 260 on vLLM 0.32's server), and every block hashed was shifted by one.
    directory = make_bos_tokenizer_dir(tmp_path / "bos")
    tok = load_tokenizer(directory)
    engine = {"name": "e", "url": "http://127.0.0.1:9", "model": "m", "kind": "vllm"}
    fleet = Fleet(parse_topology({"region": "r", "regions": [{"name": "r", "engines": [engine]}]}))
    preparer = RequestPreparer(GatewaySettings(), fleet, tok)
    bos = tok.with_special_tokens(np.empty(0, dtype=np.uint32)).tolist()
    assert bos
    chat = await preparer.chat(
        FakeClientRequest(), {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    )
    responses = await preparer.responses(FakeClientRequest(), {"model": "m", "input": "hi"})
    assert responses.token_ids.tolist() == bos + chat.token_ids.tolist()
    # ... and so does kvgate's engine, which renders the request itself.
    served = parse_responses_request(
        orjson.dumps({"model": "m", "input": "hi"}),
        served_model="m",
        tokenizer=tok,
        history=ResponseStore().get,
    )
    assert served.gen.prompt_token_ids.tolist() == responses.token_ids.tolist()
