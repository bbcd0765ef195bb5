"""How an engine turns a chat's messages into what its chat template sees: the engine's "dialect".

vLLM and SGLang receive the client's messages and render them themselves, and they do not prepare them the
same way: a message's text parts are joined with "\\n" by vLLM and with " " by SGLang, or passed to the
template as a list of parts when the template loops over a message's content; vLLM renames a developer
message "system" when its template does not know that role. The gateway predicts an engine's KV cache from
its own rendering, so it renders in the dialect of the engines serving the model (contract 1); kvgate's own
engines render as vLLM does.

Sources (read, not copied): vLLM 0.32 ``vllm/renderers/chat_utils.py`` (``_parse_chat_message_content``,
parts joined with "\\n") and ``vllm/renderers/hf.py`` (``_detect_content_format``,
``_convert_developer_to_system``, ``_consolidate_system_messages``); SGLang
``python/sglang/srt/parser/jinja_template_utils.py`` (``detect_jinja_template_content_format``,
``process_content_for_template_format``) and ``python/sglang/srt/entrypoints/openai/serving_chat.py``
(``_apply_jinja_template``, ``normalize_tool_content``; no developer conversion).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from jinja2 import nodes

# "string": the template gets each message's content as one string; "openai": as a list of parts
# ({"type": "text", "text": ...}), for templates that loop over a message's content.
ContentFormat = Literal["string", "openai"]


class ChatContentError(ValueError):
    """A chat message whose content this deployment cannot turn into text."""


# Content parts that are text, and the field holding it: an assistant's refusal part ({"type": "refusal",
# "refusal": "..."}, OpenAI's) is text of the conversation, as vLLM renders it.
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}


def part_texts(parts: list[Any]) -> list[str]:
    """The texts of an OpenAI content array; ChatContentError for a part that is not text."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
        field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if field is None:
            raise ChatContentError(f"content part of type {kind!r} is not supported; only text is")
        if not isinstance(part.get(field), str):  # (not "only text is supported": it is text)
            raise ChatContentError(f"a content part of type {kind!r} needs its {field}, a string")
        texts.append(part[field])
    return texts


@dataclass(frozen=True, slots=True)
class ChatDialect:
    """What an engine does to the messages before its template renders them."""

    name: str
    part_separator: str  # joins a message's text parts for a "string" template (and for tool messages)
    strings_as_parts: bool  # "openai" template: a string content becomes one text part too
    developer_as_system: bool  # a template that does not name "developer" gets it as a system message
    content_format: Callable[[str, nodes.Template | None], ContentFormat]  # (source, its AST) -> format

    def messages(
        self, messages: Iterable[Mapping[str, Any]], content_format: ContentFormat, names_developer: bool
    ) -> list[dict[str, Any]]:
        """``messages`` as this engine hands them to a template of ``content_format`` (that names the
        developer role or not). ChatContentError for content that is not text."""
        as_parts = content_format == "openai"
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
                if parts:
                    value = [{"type": "text", "text": t} for t in texts]
                else:
                    value = self.part_separator.join(texts)
            elif content is None or isinstance(content, str):
                if parts and self.strings_as_parts:
                    value = [] if content is None else [{"type": "text", "text": content}]
                else:
                    value = content or ""
            else:
                raise ChatContentError("message content must be a string or an array of content parts")
            developer = developer or role == "developer"
            out.append({**message, "content": value})
        if developer and self.developer_as_system and not names_developer:
            return _system_first(out)
        return out


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


# --- content format detection on the template's AST --------------------------------------------------------


def _loads(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether ``node`` reads ``name`` (``name[key]`` or ``name.key`` with a key), possibly through filters,
    tests and slices: ``messages[1:]``, ``message['content'] | trim``, ``message.content is string``."""
    while (
        (isinstance(node, nodes.Filter) and node.node is not None)
        or isinstance(node, nodes.Test)
        or (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice))
    ):
        node = node.node  # type: ignore[assignment]  # (a Filter's node checked above; the others' are set)
    if key is None:
        return _loads(node, name)
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == key and _loads(node.node, name)
    if isinstance(node, nodes.Getattr):
        return node.attr == key and _loads(node.node, name)
    return False


class _NotAName(Exception):
    """A target vLLM's detection expects to be a plain name is not (it then falls back to "string")."""


def _name_of(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise _NotAName
    return target.name


def _aliases(ast: nodes.Template, name: str) -> list[str]:
    """``name`` and the variables ``{% set %}`` to it (or to a filtered or sliced copy), transitively."""
    found = [name]
    queue = [name]
    while queue:
        current = queue.pop(0)
        for assign in ast.find_all(nodes.Assign):
            if _reads(assign.node, current):
                alias = _name_of(assign.target)
                if alias not in found:
                    found.append(alias)
                    queue.append(alias)
    return found


def _content_loops(ast: nodes.Template) -> Iterator[nodes.For]:
    """The loops over a message's content, in template order: over ``message['content']`` (``message`` a loop
    variable over ``messages`` or an alias of it), over a macro parameter that is passed a message's
    content, or over a top-level variable named ``content``."""
    message_vars = [
        _name_of(loop.target)
        for alias in _aliases(ast, "messages")
        for loop in ast.find_all(nodes.For)
        if _reads(loop.iter, alias)
    ]

    def is_content(node: nodes.Node) -> bool:
        return any(_reads(node, var, "content") for var in message_vars)

    calls = list(ast.find_all(nodes.Call))
    content_params: dict[int, set[str]] = {}  # id(loop in a macro) -> the macro's content parameters
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in calls:
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            bound.update(params[i] for i, arg in enumerate(call.args[: len(params)]) if is_content(arg))
            bound.update(kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if bound:
                content_params[id(loop)] = bound
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if is_content(it) or (
            isinstance(it, nodes.Name)
            and (
                it.name in content_params.get(id(loop), ())
                or (id(loop) not in in_macros and it.name == "content")
            )
        ):
            _name_of(loop.target)
            yield loop


def vllm_content_format(source: str, ast: nodes.Template | None) -> ContentFormat:
    """vLLM's ``--chat-template-content-format auto``: "openai" when the template loops over a message's
    content, else (or when it cannot tell) "string"."""
    if ast is None:
        return "string"
    try:
        return "openai" if next(_content_loops(ast), None) is not None else "string"
    except _NotAName:
        return "string"


_SGLANG_MEDIA_WORDS = ("image", "audio", "video", "vision")


def sglang_content_format(source: str, ast: nodes.Template | None) -> ContentFormat:
    """SGLang's detection: "openai" for a template that names a medium anywhere in its text, or that loops
    over ``message``'s, ``msg``'s or ``m``'s content (by those names only); else "string"."""
    if any(word in source for word in _SGLANG_MEDIA_WORDS):
        return "openai"
    if ast is None:
        return "string"
    for loop in ast.find_all(nodes.For):
        if any(_reads(loop.iter, var, "content") for var in ("message", "msg", "m")):
            return "openai"
    return "string"


def names_developer(source: str) -> bool:
    """vLLM's test of whether a template knows the developer role: it spells it as a string literal."""
    return '"developer"' in source or "'developer'" in source


VLLM = ChatDialect(
    "vllm", part_separator="\n", strings_as_parts=True, developer_as_system=True,
    content_format=vllm_content_format,
)  # fmt: skip
SGLANG = ChatDialect(
    "sglang", part_separator=" ", strings_as_parts=False, developer_as_system=False,
    content_format=sglang_content_format,
)  # fmt: skip
