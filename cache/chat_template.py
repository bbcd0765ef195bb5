"""Chat templates: a conversation rendered as prompt text, exactly as an engine renders it.

The text is what gets tokenized and block-hashed (cache.tokens), so gateway and engines must render a chat
identically: the model's own Hugging Face template (Jinja) when it has one, rendered as ``transformers``
renders it, and ChatML otherwise; the messages prepared as the engine's dialect prepares them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cache.chat_dialect import PLAIN, VLLM, ChatContentError, ChatDialect, ChatInputs
from cache.template_content import ContentFormat, names_developer

if TYPE_CHECKING:
    from cache.tokens import Tokenizer


class TokenizerError(ValueError):
    """A tokenizer or chat template that cannot be loaded; the message names the file and why."""


_NO_GENERATION_PROMPT = ChatInputs(add_generation_prompt=False)


def _inputs(inputs: ChatInputs | None, add_generation_prompt: bool) -> ChatInputs:
    if inputs is not None:
        return inputs
    return PLAIN if add_generation_prompt else _NO_GENERATION_PROMPT


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    dialect: ChatDialect = VLLM,
    inputs: ChatInputs | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, then the assistant's opening.

    The messages are prepared as ``dialect``'s engine prepares them for a ChatML template (one that loops
    over no content and does not name the developer role), so this is what that engine renders.
    Rendering a conversation and then its continuation yields a text that starts with the first one, so a
    second turn's tokens extend the first turn's prompt plus its answer: that is what makes chats cacheable.
    ``inputs`` (else ``add_generation_prompt`` alone): ChatML reads no tools, documents nor variables; with
    ``continue_final_message`` the text ends where the final message's content does.
    """
    inputs = _inputs(inputs, add_generation_prompt)
    # (Each content a string, as a "string" template is given it.)
    prepared = dialect.messages(messages, "string", names_developer=False)
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in prepared]
    if inputs.continue_final_message and out:
        # (As a ChatML template renders it, cut after the final content as transformers cuts: the content
        # is written as it is, so the cut falls right at its end.)
        out[-1] = out[-1][: -len("<|im_end|>\n")]
    elif inputs.add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def render_messages(
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    dialect: ChatDialect = VLLM,
    inputs: ChatInputs | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """A conversation as prompt text, as an engine of ``dialect`` renders it: the model's own chat template
    when it has one, ChatML otherwise. Gateway and engines both call this, so they tokenize a chat
    identically (kvgate's engines in vLLM's dialect; the gateway in its engines', gateway.prepare).
    ``inputs``: what else the template is given (``dialect.chat_inputs(body)`` of the request); without
    them, nothing but ``add_generation_prompt``."""
    inputs = _inputs(inputs, add_generation_prompt)
    if tokenizer.chat_template is not None:
        return tokenizer.chat_template.render(messages, dialect=dialect, inputs=inputs)
    return render_chat(messages, dialect=dialect, inputs=inputs)


# transformers marks the end of the message to continue with this, renders, and cuts the text there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """``messages`` with the final one's content (its last text part, for a list) followed by the tag, and
    that content: what transformers renders for ``continue_final_message``."""
    final = dict(messages[-1])
    content = final.get("content")
    if isinstance(content, list):
        parts: list[dict[str, Any]] = [dict(p) for p in content]
        # (The last part with text, found by index: mypyc cannot compile reversed() over these.)
        last = next((i for i in range(len(parts) - 1, -1, -1) if "text" in parts[i]), None)
        if last is None:
            raise ChatContentError(
                "continue_final_message is set but the final message has no text to continue"
            )
        text = parts[last]["text"]
        parts[last]["text"] = text + _CONTINUE_TAG
        final["content"] = parts
    elif isinstance(content, str):
        text = content
        final["content"] = content + _CONTINUE_TAG
    else:
        raise ChatContentError('continue_final_message is set but the final message has no "content"')
    return [*messages[:-1], final], text


def _cut_after_final_message(rendered: str, final: str) -> str:
    """The rendered chat up to the end of the tagged final message, as transformers cuts it."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ChatContentError(
            "continue_final_message is set but the final message does not appear in the chat after applying "
            "the chat template"
        )
    at = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, at):
        return rendered[:at]
    return rendered[:at].rstrip()  # (the template trimmed the tag's trailing space: cut with care)


class ChatTemplate:
    """A Hugging Face chat template (Jinja, in ``tokenizer_config.json``), rendered the way
    ``transformers`` renders it: sandboxed, with ``trim_blocks`` and ``lstrip_blocks``."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2

        from cache.chat_template_env import template_environment

        def raise_exception(message: str) -> None:
            raise ChatContentError(message)

        env = template_environment(raise_exception)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"the chat template does not compile: {exc}") from None
        # What Template.render merges under the variables on every call (a ChainMap of the template's and
        # the environment's globals, copied key by key): merged once here, render takes 0.4x the time.
        self._globals = dict(self._template.globals)
        self._globals.update(bos_token=bos_token, eos_token=eos_token)  # (request variables may override)
        self._source = source
        self._ast = self._template.environment.parse(source)  # (it compiled: it parses)
        self._names_developer = names_developer(source)
        self._formats: dict[str, ContentFormat] = {}

    def render(
        self,
        messages: Iterable[Mapping[str, Any]],
        *,
        dialect: ChatDialect = VLLM,
        inputs: ChatInputs | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat as transformers' apply_chat_template renders it for ``dialect``'s engine: the messages as
        that engine prepares them, ``inputs``' tools, documents, add_generation_prompt and variables (the
        variables over the special tokens, under the rest), and continue_final_message's cut."""
        import jinja2

        inputs = _inputs(inputs, add_generation_prompt)
        prepared = dialect.messages(messages, self.content_format(dialect), self._names_developer)
        final = None
        if inputs.continue_final_message:
            if "content" not in self._source:  # (transformers' own check)
                raise ChatContentError("continue_final_message is set but the chat template reads no content")
            if not prepared:
                raise ChatContentError("continue_final_message is set but the conversation is empty")
            prepared, final = _tag_final_message(prepared)
        variables = {**self._globals, **inputs.variables, "messages": prepared, "tools": inputs.tools,
                     "documents": inputs.documents,
                     "add_generation_prompt": inputs.add_generation_prompt}  # fmt: skip
        template = self._template
        try:
            # Template.render(**variables) is exactly this, after merging the globals under the variables.
            rendered = "".join(template.root_render_func(template.new_context(variables, shared=True)))
        except jinja2.TemplateError as exc:
            raise ChatContentError(f"the model's chat template failed: {exc}") from None
        return rendered if final is None else _cut_after_final_message(rendered, final)

    def content_format(self, dialect: ChatDialect) -> ContentFormat:
        """How ``dialect``'s engine passes message content to this template, detected once per dialect (the
        engines detect it once per template too)."""
        found = self._formats.get(dialect.name)
        if found is None:
            found = self._formats[dialect.name] = dialect.content_format(self._source, self._ast)
        return found


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The model's ``chat_template`` (``tokenizer_config.json`` or ``chat_template.jinja``), if any."""
    config_path = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise TokenizerError(f"{config_path}: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # several named templates: take the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    jinja_path = model_dir / "chat_template.jinja"
    if not source and jinja_path.is_file():
        source = jinja_path.read_text()
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(
        source, bos_token=_token_text(config.get("bos_token")), eos_token=_token_text(config.get("eos_token"))
    )


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""
