"""A Responses API request's ``tools`` and ``tool_choice`` as vLLM 0.32 takes them for a chat template: its
flat tools (``{"type": "function", "name": ..., "parameters": ...}``) as chat tools, namespaced functions and
custom tools as the functions vLLM shows the model, and the tool choice as vLLM validates it
(``cache.responses_input`` builds the rest of the request's chat body).

Sources (read, not copied): vLLM 0.32 ``entrypoints/openai/responses/utils.py`` (``construct_tool_dicts``),
``tool_parsers/utils.py`` (``get_function_tools``, ``custom_tool_parameters``),
``entrypoints/openai/responses/protocol.py`` (``check_tool_usage``, ``_resolve_named_tool_choice``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cache.chat_dialect import ChatContentError

NAMESPACE_SEPARATOR = (
    "__"  # a namespaced function is shown as "<namespace>__<name>" (flat_namespace_tool_name)
)
CUSTOM_INPUT_KEY = "input"  # a custom tool is shown as a function of one string argument, "input"
_CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {
        CUSTOM_INPUT_KEY: {"type": "string", "description": "The freeform text payload for this tool."}
    },
    "required": [CUSTOM_INPUT_KEY],
    "additionalProperties": False,
}
_CHOICES = ("none", "auto", "required")


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The Responses tools as the chat tools vLLM renders (get_function_tools): function tools, each
    namespaced function as ``<namespace>__<name>``, each custom tool as a function of one string; other tools
    (web search, MCP, ...) are not shown to the model."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if not isinstance(kind, str):
            raise ChatContentError(f"tools[{i}] must be an object with a type", param=f"tools[{i}]")
        if kind == "function":
            out.append(_function(tool, tool.get("name"), f"tools[{i}]"))
        elif kind == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                raise ChatContentError(f"tools[{i}] needs its name and its tools", param=f"tools[{i}]")
            for j, member in enumerate(inner):
                if isinstance(member, Mapping) and member.get("type") == "function":  # (custom ones are not)
                    name = member.get("name")
                    flat = f"{namespace}{NAMESPACE_SEPARATOR}{name}" if isinstance(name, str) else None
                    out.append(_function(member, flat, f"tools[{i}].tools[{j}]"))
        elif kind == "custom":
            grammar = tool.get("format")
            if isinstance(grammar, Mapping) and grammar.get("type") == "grammar":
                raise ChatContentError(
                    "Custom tools with a grammar format are not supported; only free-form text custom tools "
                    "are accepted.",
                    param="tools",
                )
            shim = {"description": tool.get("description"), "parameters": _CUSTOM_PARAMETERS}
            out.append(_function(shim, tool.get("name"), f"tools[{i}]"))
    return out


def _function(tool: Mapping[str, Any], name: Any, where: str) -> dict[str, Any]:
    """A function tool as the chat tool vLLM dumps it (ChatCompletionToolsParam): name, description and
    parameters always (null when not given), strict and defer_loading only when given."""
    if not isinstance(name, str):
        raise ChatContentError(f"{where} needs its name, a string", param=where)
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool), ("defer_loading", bool)):
        if tool.get(key) is not None and not isinstance(tool[key], kind):
            raise ChatContentError(f"{where}.{key} must be a {kind.__name__}", param=f"{where}.{key}")
    function = {"name": name, "description": tool.get("description"), "parameters": tool.get("parameters")}
    for key in ("strict", "defer_loading"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def tool_choice(choice: Any, tools: list[Any]) -> Any:
    """``tool_choice`` as vLLM validates it (check_tool_usage), in the chat API's form: "none" for "auto"
    without tools; a named function or custom tool (a namespaced function may be named by its own name when
    that is unambiguous) as ``{"type": "function", "function": {"name": ...}}``; any other object (allowed
    tools, a built-in tool) as "auto". No choice changes what the template renders."""
    if isinstance(choice, str) and choice in _CHOICES:
        if not tools and choice == "required":
            raise ChatContentError(
                "Tool choice 'required' must be specified with 'tools' parameter.", param="tool_choice"
            )
        return "none" if not tools else choice
    if not isinstance(choice, Mapping):
        raise ChatContentError("tool_choice must be none, auto, required or an object", param="tool_choice")
    if choice.get("type") not in ("function", "custom"):
        return "auto"
    name = choice.get("name")
    if not tools or not isinstance(name, str) or not name:
        raise ChatContentError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
    return {"type": "function", "function": {"name": _resolved_name(name, tools)}}


def _resolved_name(name: str, tools: list[Any]) -> str:
    """``name`` as the tool the model is shown: a tool's own name, a namespaced function's flat name, or a
    namespaced function's own name when one namespace alone has it."""
    exact: set[str] = set()
    local: dict[str, list[str]] = {}
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        if tool.get("type") == "namespace":
            namespace, inner = tool.get("name"), tool.get("tools")
            if not isinstance(namespace, str) or not isinstance(inner, list):
                return name  # (vLLM leaves the name as it is)
            for member in inner:
                member_name = member.get("name") if isinstance(member, Mapping) else None
                if isinstance(member_name, str):
                    flat = f"{namespace}{NAMESPACE_SEPARATOR}{member_name}"
                    exact.add(flat)
                    local.setdefault(member_name, []).append(flat)
        elif isinstance(tool.get("name"), str):
            exact.add(tool["name"])
    if name in exact:
        return name
    candidates = local.get(name, [])
    if len(candidates) > 1:
        raise ChatContentError(
            f"Tool choice '{name}' is ambiguous: it is defined in more than one namespace "
            f"({', '.join(candidates)}). Select it by its full '<namespace>__<name>' name.",
            param="tool_choice",
        )
    if not candidates:
        raise ChatContentError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
    return candidates[0]
