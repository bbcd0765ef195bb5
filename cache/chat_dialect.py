"""How an engine turns a chat's messages into what its chat template sees: the engine's "dialect".

vLLM and SGLang receive the client's messages and render them themselves, and they do not prepare them the
same way: a message's text parts are joined with "\\n" by vLLM and with " " by SGLang, or passed to the
template as a list of parts when the template loops over a message's content; vLLM renames a developer
message "system" when its template does not know that role. The gateway predicts an engine's KV cache from
its own rendering, so it renders in the dialect of the engines serving the model (contract 1); kvgate's own
engines render as vLLM does. What a template does with the content is read off it in
``cache.template_content``.

Sources (read, not copied): vLLM 0.32 ``vllm/renderers/chat_utils.py`` (``_parse_chat_message_content``,
parts joined with "\\n") and ``vllm/renderers/hf.py``
(``_convert_developer_to_system``, ``_consolidate_system_messages``); SGLang
``python/sglang/srt/parser/jinja_template_utils.py`` (``process_content_for_template_format``) and
``python/sglang/srt/entrypoints/openai/serving_chat.py``
(``_apply_jinja_template``, ``normalize_tool_content``; no developer conversion).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jinja2 import nodes

from cache.template_content import ContentFormat, sglang_content_format, vllm_content_format


class ChatContentError(ValueError):
    """A chat this deployment cannot render (a 400): ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class MediaContentError(ChatContentError):
    """A content part that is media (an image, audio, a file: any part of a type that is not text), which only
    a multimodal engine reads. An engine without media refuses it; the gateway forwards it, rendering only the
    text for its prediction (``media_free``)."""


# Content parts that are text, and the field holding it, as vLLM 0.32 reads them (MM_PARSER_MAP in
# renderers/chat_utils.py): an assistant's refusal part ({"type": "refusal", "refusal": "..."}, OpenAI's) is
# text of the conversation; so are the Responses API's input_text and output_text parts (a Responses request's
# messages reach the chat template with them) and a "thinking" part's thinking.
_TEXT_PARTS = {"text": "text", "refusal": "refusal", "input_text": "text", "output_text": "text",
               "thinking": "thinking"}  # fmt: skip


def part_texts(parts: list[Any]) -> list[str]:
    """The texts of an OpenAI content array (a part may be a plain string, as vLLM takes it); ChatContentError
    for a part that is not text."""
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None:
            error = MediaContentError if isinstance(kind, str) else ChatContentError
            raise error(f"content part of type {kind!r} is not supported; only text is")
        if not isinstance(part.get(field), str):  # (not "only text is supported": it is text)
            raise ChatContentError(f"a content part of type {kind!r} needs its {field}, a string")
        texts.append(part[field])
    return texts


def is_media(part: Any) -> bool:
    """Whether a content part is media (see ``MediaContentError``): an object whose type names no text."""
    return isinstance(part, Mapping) and isinstance(part.get("type"), str) and part["type"] not in _TEXT_PARTS


def media_free(parts: list[Any]) -> list[Any]:
    """A content array without its media parts: what of it a text-only rendering reads."""
    return [part for part in parts if not is_media(part)]


@dataclass(frozen=True, slots=True)
class ChatInputs:
    """What a chat template is given besides the messages, as an engine takes it from the request body."""

    tools: list[Any] | None = None  # the ``tools`` variable: a list of tool dicts, or None (none given)
    documents: list[Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the final message left open: the model writes on from its end
    # Other template variables: chat_template_kwargs, reasoning_effort.
    variables: Mapping[str, Any] = field(default_factory=dict)


PLAIN = ChatInputs()  # a chat with nothing but messages: what every template was given before ChatInputs


@dataclass(frozen=True, slots=True)
class ChatDialect:
    """What an engine does to the messages before its template renders them."""

    name: str
    part_separator: str  # joins a message's text parts for a "string" template (and for tool messages)
    strings_as_parts: bool  # "openai" template: a string content becomes one text part too
    developer_as_system: bool  # a template that does not name "developer" gets it as a system message
    content_format: Callable[[str, nodes.Template | None], ContentFormat]  # (source, its AST) -> format
    # vLLM's normalization: only the keys it knows per role; tool call arguments parsed to objects.
    normalizes_messages: bool
    chat_inputs: Callable[[Mapping[str, Any]], ChatInputs]  # a request body -> its template inputs

    def messages(
        self, messages: Iterable[Mapping[str, Any]], content_format: ContentFormat, names_developer: bool
    ) -> list[dict[str, Any]]:
        """``messages`` as this engine hands them to a template of ``content_format`` (that names the
        developer role or not). ChatContentError for content that is not text."""
        as_parts = content_format == "openai"
        normalize = self.normalizes_messages
        out = []
        developer = False
        for message in messages:
            content = message.get("content")
            role = message.get("role")
            # Tool results go to templates as strings whatever their format: both engines flatten them.
            parts = as_parts and role != "tool"
            value: Any
            if isinstance(content, list):
                texts = part_texts(content)
                if normalize and role == "system":
                    texts = _without_billing_header(texts, content)
                if parts:
                    value = [{"type": "text", "text": t} for t in texts]
                else:
                    value = self.part_separator.join(texts)
            elif content is None or isinstance(content, str):
                if normalize and role == "system" and content and content.startswith(_BILLING_HEADER):
                    content = "".join(_without_billing_header([content])) or None  # (None: no part left)
                if parts and self.strings_as_parts:
                    value = [] if content is None else [{"type": "text", "text": content}]
                else:
                    value = content or ""
            else:
                raise ChatContentError("message content must be a string or an array of content parts")
            developer = developer or role == "developer"
            if not normalize:
                out.append({**message, "content": value})
            elif len(message) <= 2 and role != "developer" and ("content" in message or len(message) < 2):
                # (Role and content alone: the common message; an assistant's role and tool calls are not.)
                out.append({"role": role, "content": value})
            else:
                out.append(_vllm_message(message, role, value))
        if developer and self.developer_as_system and not names_developer:
            return _system_first(out)
        return out


# Claude Code's attribution line at the head of its system prompt changes with every request; vLLM drops it
# (a prompt that kept it would miss the prefix cache from there on), so the gateway must too.
_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(texts: list[str], parts: list[Any] | None = None) -> list[str]:
    """A system message's texts as vLLM keeps them: a text opening with the billing header loses its first
    line, and goes when nothing follows it. ``parts``: the content array the texts come from, one each; vLLM
    looks only at its strings and its parts of type "text" (an input_text part keeps the line)."""
    if not any(t.startswith(_BILLING_HEADER) for t in texts):
        return texts
    kept = []
    for i, text in enumerate(texts):
        part = None if parts is None else parts[i]
        if text.startswith(_BILLING_HEADER) and (isinstance(part, str | None) or part.get("type") == "text"):
            text = text.partition("\n")[2]
            if not text:
                continue
        kept.append(text)
    return kept


def _vllm_message(message: Mapping[str, Any], role: Any, content: Any) -> dict[str, Any]:
    """A message as vLLM hands it to a template: role and content, and of the rest only what vLLM keeps for
    the role (an assistant's tool calls and reasoning, a tool result's call id, a name, a developer message's
    tools), in vLLM's order (a template may write a message out whole with ``tojson``)."""
    out: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            prepared = _tool_calls(calls)
            if prepared:  # (an empty list is dropped: the template takes the plain assistant path)
                out["tool_calls"] = prepared
        reasoning = message.get("reasoning")
        if reasoning is None:  # the deprecated name, read when the new one is missing
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


_CALL_KEYS = ("id", "function", "type")  # the order vLLM's validation (pydantic) writes a tool call's keys in
_FUNCTION_KEYS = ("arguments", "name")


def _reordered(item: Mapping[str, Any], known: tuple[str, ...]) -> dict[str, Any]:
    """``item`` with its ``known`` keys first, in that order, then the others as they came."""
    out = {k: item[k] for k in known if k in item}
    out.update((k, v) for k, v in item.items() if k not in out)
    return out


class ToolCallAsBuilt(dict[str, Any]):
    """A tool call whose keys, and its function's, reach the template in the order they are in: vLLM's
    Responses API builds an assistant's tool calls from function_call items itself (``{"id", "function":
    {"name", "arguments"}, "type"}``) and renders them unvalidated, where its chat API's validation writes a
    function's ``arguments`` before its ``name`` (a template may write a call out whole with ``tojson``)."""


def _tool_calls(calls: Any) -> list[dict[str, Any]]:
    """An assistant's tool calls as vLLM gives them to templates: each function's ``arguments`` (a JSON
    string from OpenAI clients) parsed to an object, as templates expect; malformed JSON, or JSON that is not
    an object, becomes {} (vLLM's choice: refusing it would fail every later turn of the conversation)."""
    if not isinstance(calls, list):
        raise ChatContentError("an assistant message's tool_calls must be an array")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(call, Mapping) or call.get("type", "function") != "function":
            raise ChatContentError("an assistant message's tool_calls must be objects of type 'function'")
        if not isinstance(function, Mapping):
            raise ChatContentError("an assistant message's tool call needs its function, an object")
        as_built = isinstance(call, ToolCallAsBuilt)
        prepared = dict(function) if as_built else _reordered(function, _FUNCTION_KEYS)
        prepared["arguments"] = _arguments(function.get("arguments"))
        out.append({**(call if as_built else _reordered(call, _CALL_KEYS)), "function": prepared})
    return out


def _arguments(raw: Any) -> Any:
    if not raw:  # missing, null, "": no arguments
        return {}
    parsed = raw
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)  # (Python's json, as vLLM: NaN and duplicate keys read as it reads them)
        except ValueError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM for a template without the developer role: developer messages become system ones (their
    ``tools`` dropped), and system messages that are not one leading message are merged into one, first:
    their texts joined with a blank line (a list content's parts with "\\n"), empty ones left out."""
    converted = [
        {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}
        if m.get("role") == "developer"
        else m
        for m in messages
    ]
    texts: list[str] = []
    others = []
    merge = False
    for i, message in enumerate(converted):
        if message.get("role") != "system":
            others.append(message)
            continue
        merge = merge or i > 0 or bool(texts)
        content = message["content"]
        text = content if isinstance(content, str) else "\n".join(p["text"] for p in content)
        if text:
            texts.append(text)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]


# --- what the template is given besides the messages --------------------------------------------------------

# apply_chat_template's own parameters (transformers 5): a chat_template_kwargs key among them is taken as
# that parameter, not handed to the template as a variable.
_APPLY_PARAMETERS = frozenset({
    "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message", "tokenize",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})  # fmt: skip
_INPUT_FIELDS = frozenset({
    "tools", "documents", "add_generation_prompt", "continue_final_message", "reasoning_effort",
    "chat_template_kwargs",
})  # fmt: skip
_UNSET = (None, "auto")  # vLLM's merge of template kwargs skips an override of either value


def _bool_field(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatContentError(f"{name} must be a boolean", param=name)
    return value


def _tool_dict(tool: Any, i: int) -> dict[str, Any]:
    """A ``tools`` entry as vLLM gives it to templates (its ChatCompletionToolsParam dumped): the known keys
    only, ``description`` and ``parameters`` always there (null when not given), ``strict`` and
    ``defer_loading`` only when given."""
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ChatContentError(f"{where} must be an object of type 'function'", param=where)
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatContentError(f"{where}.function must be an object with a name", param=f"{where}.function")
    checks = (("description", str), ("parameters", dict), ("strict", bool), ("defer_loading", bool))
    for key, kind in checks:
        if function.get(key) is not None and not isinstance(function[key], kind):
            param = f"{where}.function.{key}"
            raise ChatContentError(f"{param} must be a {kind.__name__}", param=param)
    defer = tool.get("defer_loading")
    if defer is not None and not isinstance(defer, bool):
        raise ChatContentError(f"{where}.defer_loading must be a boolean", param=f"{where}.defer_loading")
    out = {"name": function["name"], "description": function.get("description"),
           "parameters": function.get("parameters")}  # fmt: skip
    if function.get("strict") is not None:
        out["strict"] = function["strict"]
    deferred = function.get("defer_loading")
    if deferred is None:
        deferred = defer  # (vLLM copies the tool's flag to a function without its own)
    if deferred is not None:
        out["defer_loading"] = deferred
    tool_dict: dict[str, Any] = {"type": "function", "function": out}
    if defer is not None:
        tool_dict["defer_loading"] = defer
    return tool_dict


def vllm_chat_inputs(body: Mapping[str, Any]) -> ChatInputs:
    """The template inputs vLLM 0.32 takes from a chat request: ``tools`` (dumped as its models dump them;
    given whatever ``tool_choice`` says, vLLM's default), ``documents``, ``add_generation_prompt`` (default
    true), ``continue_final_message``, ``reasoning_effort`` (and ``enable_thinking`` from it, unless
    chat_template_kwargs sets that), and ``chat_template_kwargs``, merged in vLLM's order: the request's
    fields over its chat_template_kwargs, those over the tools, a value of null or "auto" overriding nothing.
    ChatContentError (a 400, as vLLM's) for a field of the wrong shape."""
    if _INPUT_FIELDS.isdisjoint(body):
        return PLAIN  # (the common chat, answered without building anything)
    raw_tools = body.get("tools")
    if raw_tools is not None and not isinstance(raw_tools, list):
        raise ChatContentError("tools must be an array of tools", param="tools")
    tools = None if raw_tools is None else [_tool_dict(t, i) for i, t in enumerate(raw_tools)]
    documents = body.get("documents")
    if documents is not None and not (
        isinstance(documents, list)
        and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents)
    ):
        raise ChatContentError("documents must be an array of objects of strings", param="documents")
    user = body.get("chat_template_kwargs")
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise ChatContentError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key in ("messages", "conversation", "chat_template"):  # (vLLM fails on these, or refuses them)
        if user.get(key) is not None:
            raise ChatContentError(
                f"chat_template_kwargs may not set {key!r}", param=f"chat_template_kwargs.{key}"
            )
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise ChatContentError("reasoning_effort must be a string", param="reasoning_effort")
    add_generation_prompt = _bool_field(body, "add_generation_prompt", True)
    continue_final_message = _bool_field(body, "continue_final_message", False)
    if add_generation_prompt and continue_final_message:
        raise ChatContentError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    fields: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message,
                              "documents": documents, "reasoning_effort": effort}  # fmt: skip
    if effort is not None and "enable_thinking" not in user:
        fields["enable_thinking"] = effort != "none"
    request = {**user, **{k: v for k, v in fields.items() if v not in _UNSET}}
    merged = {"tools": tools, **{k: v for k, v in request.items() if v not in _UNSET}}
    merged_tools = merged["tools"]
    if merged_tools is not None and not (
        isinstance(merged_tools, list) and all(isinstance(t, dict) for t in merged_tools)
    ):
        raise ChatContentError("chat_template_kwargs.tools must be an array of objects", param="tools")
    merged_documents = merged.get("documents")
    if merged_documents is not None and not (
        isinstance(merged_documents, list) and all(isinstance(d, dict) for d in merged_documents)
    ):
        raise ChatContentError("documents must be an array of objects", param="documents")
    return ChatInputs(
        tools=merged_tools,
        documents=merged_documents,
        add_generation_prompt=merged["add_generation_prompt"] is True,
        continue_final_message=merged["continue_final_message"] is True,
        variables={k: v for k, v in merged.items() if k not in _APPLY_PARAMETERS},
    )


def plain_chat_inputs(body: Mapping[str, Any]) -> ChatInputs:
    """SGLang's: not modelled yet (it always adds the generation prompt, and renders tools, a final
    assistant message and continue_final_message its own way), so its chats render as they did."""
    return PLAIN


VLLM = ChatDialect(
    "vllm", part_separator="\n", strings_as_parts=True, developer_as_system=True,
    content_format=vllm_content_format, normalizes_messages=True, chat_inputs=vllm_chat_inputs,
)  # fmt: skip
SGLANG = ChatDialect(
    "sglang", part_separator=" ", strings_as_parts=False, developer_as_system=False,
    content_format=sglang_content_format, normalizes_messages=False, chat_inputs=plain_chat_inputs,
)  # fmt: skip
