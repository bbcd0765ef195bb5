"""What a chat template does with a message's content, read off its Jinja AST as vLLM and SGLang read it:
whether it loops over the content (then each engine hands it a list of parts, "openai") or writes it out
whole ("string"), and whether it knows the developer role.

Sources (read, not copied): vLLM 0.32 ``vllm/renderers/hf.py`` (``_detect_content_format`` and its helpers,
``_detect_developer_role_support``); SGLang ``python/sglang/srt/parser/jinja_template_utils.py``
(``detect_jinja_template_content_format``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from jinja2 import nodes

# "string": the template gets each message's content as one string; "openai": as a list of parts
# ({"type": "text", "text": ...}), for templates that loop over a message's content.
ContentFormat = Literal["string", "openai"]


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
