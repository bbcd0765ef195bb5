"""OpenAI request fields that the gateway and the engine must read the same way (they share no other code)."""

from __future__ import annotations

from typing import Any


def tools_requested(body: dict[str, Any]) -> str | None:
    """The field through which a request asks for tool (function) calling, or None: ``tools`` or the legacy
    ``functions`` when non-empty, ``tool_choice`` or ``function_call`` when anything but ``"none"``."""
    for name in ("tools", "functions"):
        if body.get(name):
            return name
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            return name
    return None
