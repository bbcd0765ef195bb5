"""A Responses API request (``POST /v1/responses``) as the chat-completions body whose rendering is the prompt
vLLM 0.32 renders for it: gateway and engine hash and compute the prompt a vLLM engine would (contract 1).

vLLM serves the Responses API of a non-Harmony model through its chat path: the request's ``input`` items
become chat messages (``construct_input_messages``), its flat tools become chat tools
(``construct_tool_dicts``), and the chat template renders them with ``reasoning.effort``,
``chat_template_kwargs`` and a partial final message to continue (``should_continue_final_message``).
:func:`responses_chat_body` makes that chat body; ``dialect.chat_inputs(chat)`` and
``cache.chat_template.render_messages(..., chat["messages"], ...)`` with the VLLM dialect render it.

Items are taken as vLLM's request validation leaves them (openai's pydantic types): a function_call or
reasoning item, or an assistant "message" item with output_text parts, becomes a typed object; every other
item stays the dict it was, with its keys. Sources (read, not copied): vLLM 0.32
``entrypoints/openai/responses/{utils.py,protocol.py}`` (``input_item_parsing``, ``check_tool_usage``,
``build_chat_params``), ``renderers/online_renderer.py`` (``render_responses``),
``tool_parsers/utils.py`` (``get_function_tools``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from cache.chat_dialect import ChatContentError, MediaContentError, ToolCallAsBuilt
from cache.responses_tools import CUSTOM_INPUT_KEY, NAMESPACE_SEPARATOR, chat_tools, tool_choice

_PARTIAL = ("in_progress", "incomplete")  # an item's status that makes vLLM continue the final message
_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})  # openai's Reasoning
_OUTPUT_STATUSES = frozenset({"in_progress", "completed", "incomplete"})
# The content parts of an input message (openai's ResponseInputContentParam) that are text; the others
# (input_image, input_file, input_audio) are media, which the gateway does not render.
_INPUT_TEXT = "input_text"


def responses_chat_body(
    body: Mapping[str, Any],
    history: Sequence[Mapping[str, Any]] | None = None,
    previous_output: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The chat-completions body that renders, in the VLLM dialect, to the prompt vLLM 0.32 renders for the
    Responses request ``body`` (a non-Harmony model): ``messages``, ``tools``, ``tool_choice``,
    ``reasoning_effort``, ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``
    (and ``model`` when given). ``history``: the chat messages vLLM stored for the previous response (its
    input messages, as this function made them), ``previous_output``: that response's output items, for a
    request that continues one (``previous_response_id``, which the caller resolves); a stateless request
    (the full input every turn, as Codex sends with ``store: false``) needs neither.

    ChatContentError (a 400) for what vLLM refuses, naming the field: ``input`` for an item vLLM does not
    take (encrypted reasoning, an unsupported item type, an item of the wrong shape), and for content that
    is not text (images and files, which the gateway does not render). ``body`` is not modified."""
    if body.get("prompt") is not None:
        raise ChatContentError("prompt template is not supported", param="prompt")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ChatContentError("instructions must be a string", param="instructions")
    messages: list[dict[str, Any]] = []
    if instructions:  # (an empty string adds no system message)
        messages.append({"role": "system", "content": instructions})
    if history is not None:  # (instructions do not carry over from one response to the next: vLLM's rule)
        messages.extend(dict(m) for m in history if m.get("role") != "system")
    if previous_output is not None:
        messages.extend(_output_messages(previous_output))
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
        continues = False
    elif isinstance(raw_input, list):
        items: list[dict[str, Any]] = []  # (an item joins only an assistant message of the input's own)
        for i, item in enumerate(raw_input):
            _add_item(items, item, i)
        messages.extend(items)
        continues = _continues(raw_input)
    else:
        raise ChatContentError("input must be a string or an array of input items", param="input")
    chat: dict[str, Any] = {"messages": messages}
    if body.get("model") is not None:
        chat["model"] = body["model"]
    raw_tools = body.get("tools")
    if raw_tools is None:
        raw_tools = []
    if not isinstance(raw_tools, list):
        raise ChatContentError("tools must be an array of tools", param="tools")
    if raw_tools:  # (tools that are none of the model's functions still give it tools=[])
        chat["tools"] = chat_tools(raw_tools)
    chat["tool_choice"] = tool_choice(body.get("tool_choice", "auto"), raw_tools)
    effort = _effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    chat["add_generation_prompt"] = not continues
    chat["continue_final_message"] = continues
    # vLLM tokenizes the rendered Responses prompt with its TokenizeParams' default, add_special_tokens=True
    # (a chat's is false): a tokenizer that adds a BOS (Llama's, Mistral's) adds one before the template's
    # text, which may hold a BOS of its own. Seen on vLLM's server: 261 input_tokens where the chat is 260.
    chat["add_special_tokens"] = True
    return chat


# --- input items -> messages --------------------------------------------------------------------------------


def _add_item(messages: list[dict[str, Any]], item: Any, i: int) -> None:
    """Append input item ``i`` to ``messages`` as vLLM does (construct_chat_messages_with_tool_call): a
    function call, reasoning or assistant text joins the assistant message just before it when that one has
    no such part yet, else starts one of its own."""
    if not isinstance(item, Mapping):
        raise ChatContentError(f"input[{i}] must be an object (an input item)", param="input")
    kind = item.get("type")
    previous = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if kind in ("function_call", "custom_tool_call"):
        call = _tool_call(item, i)
        calls = None if previous is None else previous.get("tool_calls")
        if previous is not None and calls is None:
            previous["tool_calls"] = [call]
        elif previous is not None and isinstance(calls, list):
            previous["tool_calls"] = [*calls, call]  # (a copy: a client's own list is left as it is)
        else:  # (none before, or calls vLLM cannot add to)
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif kind == "reasoning":
        reasoning = _reasoning(item, i)
        if previous is not None and previous.get("reasoning") is None:
            previous["reasoning"] = reasoning
        else:
            messages.append({"role": "assistant", "reasoning": reasoning})
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not isinstance(output, str | list):
            raise ChatContentError(
                f"input[{i}]: a {kind} item needs its call_id (a string) and its output (a string or an "
                "array of content parts)",
                param="input",
            )
        content = output if isinstance(output, str) else _text_parts(output, i)
        messages.append({"role": "tool", "content": content, "tool_call_id": call_id})
    elif kind == "message" or (kind is None and "role" in item):
        _add_message(messages, previous, item, i)
    else:
        raise ChatContentError(f"Unsupported input item type: {kind}", param="input")


def _add_message(
    messages: list[dict[str, Any]], previous: dict[str, Any] | None, item: Mapping[str, Any], i: int
) -> None:
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "system", "developer", "assistant") or not isinstance(content, str | list):
        raise ChatContentError(
            f"input[{i}]: a message needs a role (user, system, developer or assistant) and its content (a "
            "string or an array of content parts)",
            param="input",
        )
    if role == "assistant":
        text = _assistant_text(item, content, i)
        if text is not None:
            if previous is not None and previous.get("content") is None:
                previous["content"] = text
            else:
                messages.append({"role": "assistant", "content": text})
            return
    # Any other message reaches the chat template as the item itself; of its keys, vLLM reads these.
    message: dict[str, Any] = {
        "role": role,
        "content": content if isinstance(content, str) else _text_parts(content, i),
    }
    for key in ("name", "task"):
        if key in item:
            message[key] = item[key]
    if role == "developer" and "tools" in item:
        message["tools"] = item["tools"]
    if role == "assistant":  # (one whose first part has no text: its calls stay as the client wrote them)
        calls = item.get("tool_calls")
        if calls is not None:
            message["tool_calls"] = (
                [ToolCallAsBuilt(c) if isinstance(c, Mapping) else c for c in calls]
                if isinstance(calls, list)
                else calls
            )
        if "reasoning" in item:
            message["reasoning"] = item["reasoning"]
    messages.append(message)


def _assistant_text(item: Mapping[str, Any], content: str | list[Any], i: int) -> str | None:
    """The text vLLM takes from an assistant message item: a string content; else the text of its first part
    (none when that part has none: the item then reaches the template as it is). A "message" item whose parts
    are all output_text or refusal parts is an output message (ResponseOutputMessage) to vLLM, read only for
    its first part, which must be output_text."""
    if isinstance(content, str):
        return content
    if item.get("type") == "message" and all(
        isinstance(p, Mapping) and p.get("type") in ("output_text", "refusal") for p in content
    ):
        for part in content:
            field = "text" if part["type"] == "output_text" else "refusal"
            if not isinstance(part.get(field), str):
                raise ChatContentError(
                    f"input[{i}]: a {part['type']} part needs its {field}, a string", param="input"
                )
        if item.get("status") is not None and item["status"] not in _OUTPUT_STATUSES:
            raise ChatContentError(
                f"input[{i}]: status must be one of {sorted(_OUTPUT_STATUSES)}", param="input"
            )
        if not content or content[0]["type"] != "output_text":  # (vLLM fails on these: an internal error)
            raise ChatContentError(
                f"input[{i}]: an assistant message must begin with an output_text part", param="input"
            )
        text: str = content[0]["text"]
        return text
    parts = _text_parts(content, i)  # (input parts, as in any other message)
    return parts[0]["text"] if parts else None


def _text_parts(parts: list[Any], i: int) -> list[Any]:
    """``parts`` (an input message's content, or a tool output's), checked to be text: input_text parts, each
    with its text. Media (images, files) the gateway does not render."""
    for part in parts:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != _INPUT_TEXT:
            error = MediaContentError if isinstance(kind, str) else ChatContentError
            raise error(
                f"input[{i}]: content part of type {kind!r} is not supported; only input_text is",
                param="input",
            )
        if not isinstance(part.get("text"), str):
            raise ChatContentError(f"input[{i}]: an input_text part needs its text, a string", param="input")
    return parts


def _tool_call(item: Mapping[str, Any], i: int) -> ToolCallAsBuilt:
    """A function_call item (a namespaced function's name flattened) or a custom_tool_call item (its input
    the one argument of the function a custom tool is shown as) as the assistant's tool call vLLM makes."""
    kind = item["type"]
    call_id, name = item.get("call_id"), item.get("name")
    if kind == "function_call":
        arguments, namespace = item.get("arguments"), item.get("namespace")
        if not all(isinstance(v, str) for v in (call_id, name, arguments)) or not isinstance(
            namespace, str | None
        ):
            raise ChatContentError(
                f"input[{i}]: a function_call item needs its call_id, name and arguments, strings",
                param="input",
            )
        if namespace:
            name = f"{namespace}{NAMESPACE_SEPARATOR}{name}"
    else:
        payload = item.get("input")
        if not all(isinstance(v, str) for v in (call_id, name, payload)):
            raise ChatContentError(
                f"input[{i}]: a custom_tool_call item needs its call_id, name and input, strings",
                param="input",
            )
        arguments = json.dumps({CUSTOM_INPUT_KEY: payload}, ensure_ascii=False)
    return ToolCallAsBuilt(id=call_id, function={"name": name, "arguments": arguments}, type="function")


def _reasoning(item: Mapping[str, Any], i: int) -> str:
    """A reasoning item's text as vLLM reads it: its first content text, else its first summary text."""
    summary, content, encrypted = item.get("summary"), item.get("content"), item.get("encrypted_content")
    if (
        not _texts_of(summary, "summary_text")
        or not (content is None or _texts_of(content, "reasoning_text"))
        or not isinstance(encrypted, str | None)
    ):
        raise ChatContentError(
            f"input[{i}]: a reasoning item needs its summary (an array of summary_text parts) and may have "
            "its content (reasoning_text parts)",
            param="input",
        )
    if encrypted:
        raise ChatContentError("Encrypted content is not supported.", param="input")
    if content:
        text: str = content[0]["text"]
        return text
    return str(summary[0]["text"]) if summary else ""


def _texts_of(parts: Any, kind: str) -> bool:
    return isinstance(parts, list) and all(
        isinstance(p, Mapping) and p.get("type") == kind and isinstance(p.get("text"), str) for p in parts
    )


def _continues(items: list[Any]) -> bool:
    """vLLM's should_continue_final_message: the final item is a message or reasoning item still in progress
    (or cut short), which the model writes on from its end instead of answering it."""
    last = items[-1] if items else None
    return (
        isinstance(last, Mapping) and last.get("type", "message") in ("message", "reasoning")
        and last.get("status") in _PARTIAL
    )  # fmt: skip


def _output_messages(output: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A previous response's output as vLLM carries it into the next turn: each output message part as an
    assistant message of its own; reasoning and tool calls left out."""
    messages = []
    for item in output:
        if item.get("type") != "message":
            continue
        for part in item.get("content") or []:
            if not isinstance(part, Mapping) or not isinstance(part.get("text"), str):
                raise ChatContentError(
                    "the previous response's output holds a message part without text",
                    param="previous_response_id",
                )
            messages.append({"role": "assistant", "content": part["text"]})
    return messages


def _effort(reasoning: Any) -> str | None:
    """``reasoning.effort``: vLLM hands it to the template as ``reasoning_effort`` (and turns thinking on
    unless it is "none"), as the chat API's ``reasoning_effort``."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, Mapping):
        raise ChatContentError("reasoning must be an object", param="reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise ChatContentError(
            f"reasoning.effort must be one of {', '.join(sorted(_EFFORTS))}", param="reasoning.effort"
        )
    return effort
