"""The Jinja environment chat templates are rendered in: transformers' (``apply_chat_template``), which vLLM
and SGLang render with, so that the gateway makes of a chat the prompt the engines make.

Beyond Jinja's own: a sandbox, ``trim_blocks`` and ``lstrip_blocks``, loop controls (``{% break %}``), the
``{% generation %}`` tag (transformers marks the assistant's text with it; rendered as its body),
``strftime_now`` and ``tojson`` without HTML escaping and with json.dumps' options. Without
``strftime_now``, Llama 3.1's template wrote "Today Date: 26 Jul 2024" where the engines write today's date,
so no prompt the gateway hashed was one an engine made; a template using ``{% break %}`` did not load.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: its body, as it is."""

    tags = {"generation"}  # noqa: RUF012  (Jinja reads it off the class)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def strftime_now(pattern: str) -> str:
    return datetime.now().strftime(pattern)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def template_environment(raise_exception: Callable[[str], None]) -> ImmutableSandboxedEnvironment:
    """A new environment; ``raise_exception`` is what a template's ``raise_exception(...)`` calls."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.Undefined,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env
