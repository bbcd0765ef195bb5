"""A chat rendered as vLLM and SGLang render it (cache.chat_dialect): the messages each engine hands its
template, written out here from the engines' sources, rendered by transformers, against kvgate's rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cache.chat_dialect import SGLANG, VLLM, ChatDialect
from cache.chat_template import ChatTemplate, render_chat, render_messages
from cache.tokens import load_tokenizer
from tests.models import make_tokenizer_dir

# Llama 3: one string per message (messages[1:] aliased, content trimmed).
LLAMA3 = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# Llama 4: loops over message['content'] when it is a list of parts.
LLAMA4 = (
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}{%- if messages[0]['content'] is string %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- else %}"
    "{%- set system_message = messages[0]['content'][0]['text'] | trim %}{%- endif %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{%- if system_message %}{{- '<|header_start|>system<|header_end|>\\n\\n' + system_message + '<|eot|>' }}"
    "{%- endif %}{%- for message in messages %}"
    "{{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- else %}"
    "{%- for content in message['content'] %}{%- if content['type'] == 'image' %}{{- '<|image|>' }}"
    "{%- elif content['type'] == 'text' %}{{- content['text'] | trim }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|eot|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}{%- endif %}"
)
# Qwen2-VL: parts rendered back to back, a string as is.
QWEN2VL = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}|{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}"
)
# A template that names the developer role: vLLM leaves it alone.
WITH_DEVELOPER = (
    "{%- for message in messages %}{%- if message.role == 'developer' %}<|dev|>{{ message.content }}"
    "{%- else %}<|{{ message.role }}|>{{ message.content }}{%- endif %}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
# vLLM follows `set` aliases of the messages; SGLang looks for loops over message/msg/m's content only.
ALIASED = (
    "{%- set turns = messages | selectattr('role', 'ne', 'tool') | list %}{%- for turn in turns %}"
    "<|{{ turn.role }}|>{%- for part in turn.content %}[{{ part.text }}]{%- endfor %}\n{%- endfor %}"
)
# The content handed to a macro whose parameter has another name (Mistral / Qwen3-VL style).
MACRO = (
    "{%- macro show(c) %}{%- if c is string %}{{ c }}{%- else %}{%- for item in c %}{{ item.text }}"
    "{%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}<|{{ message.role }}|>{{ show(message.content) }}{%- endfor %}"
)
# A template-level variable named "content" looped over.
CONTENT_VARIABLE = (
    "{%- for message in messages %}{%- set content = message['content'] %}<|{{ message['role'] }}|>"
    "{%- if content is string %}{{ content }}{%- else %}{%- for p in content %}{{ p['text'] }}{%- endfor %}"
    "{%- endif %}{%- endfor %}"
)
# No loop over content, but a medium named in a comment: SGLang takes it for a multimodal template.
NAMES_IMAGE = "{%- for message in messages %}{{ message['content'] }}{# no image input #}{%- endfor %}"
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "vllm", "sglang"),
    [
        (LLAMA3, "string", "string"),
        (LLAMA4, "openai", "openai"),
        (QWEN2VL, "openai", "openai"),
        (WITH_DEVELOPER, "string", "string"),
        (ALIASED, "openai", "string"),
        (MACRO, "openai", "string"),
        (CONTENT_VARIABLE, "openai", "string"),
        (NAMES_IMAGE, "string", "openai"),
        (CHATML, "string", "string"),
    ],
)
def test_each_engine_detects_the_content_format_of_a_template_as_it_does(
    template: str, vllm: str, sglang: str
) -> None:
    # (As vLLM 0.32's own _detect_content_format and SGLang's detect_jinja_template_content_format answer.)
    chat_template = ChatTemplate(template)
    assert (chat_template.content_format(VLLM), chat_template.content_format(SGLANG)) == (vllm, sglang)


PARTS = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": PARTS},
    {"role": "developer", "content": "answer in French", "tools": [{"type": "function"}]},
    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    {"role": "tool", "content": PARTS, "tool_call_id": "c1"},
    {"role": "user", "content": "again"},
]
TEXT = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]

# What each engine hands the template for CHAT (vllm/renderers/chat_utils.py and hf.py; sglang's
# jinja_template_utils.py and serving_chat.py).
VLLM_STRING = [
    {"role": "system", "content": "be brief\n\nanswer in French"},
    {"role": "user", "content": "first\nsecond"},
    {"role": "assistant", "content": "no"},
    {"role": "tool", "content": "first\nsecond", "tool_call_id": "c1"},
    {"role": "user", "content": "again"},
]
VLLM_PARTS = [
    {"role": "system", "content": "be brief\n\nanswer in French"},
    {"role": "user", "content": TEXT},
    {"role": "assistant", "content": [{"type": "text", "text": "no"}]},
    {"role": "tool", "content": "first\nsecond", "tool_call_id": "c1"},
    {"role": "user", "content": [{"type": "text", "text": "again"}]},
]
VLLM_WITH_DEVELOPER = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first\nsecond"},
    {"role": "developer", "content": "answer in French", "tools": [{"type": "function"}]},
    *VLLM_STRING[2:],
]
SGLANG_STRING = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "first second"},
    {"role": "developer", "content": "answer in French", "tools": [{"type": "function"}]},
    {"role": "assistant", "content": "no"},
    {"role": "tool", "content": "first second", "tool_call_id": "c1"},
    {"role": "user", "content": "again"},
]
SGLANG_PARTS = [
    SGLANG_STRING[0],
    {"role": "user", "content": TEXT},
    SGLANG_STRING[2],
    {"role": "assistant", "content": [{"type": "text", "text": "no"}]},
    SGLANG_STRING[4],
    SGLANG_STRING[5],
]


def _hf_render(tmp_path: Path, template: str, messages: list[dict[str, Any]]) -> str:
    from transformers import PreTrainedTokenizerFast

    directory = make_tokenizer_dir(tmp_path / "m")
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>"
    )
    rendered = hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert isinstance(rendered, str)
    return rendered


def _ours(tmp_path: Path, template: str, dialect: ChatDialect | None) -> str:
    directory = make_tokenizer_dir(tmp_path / "ours")
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(directory)
    if dialect is None:  # kvgate's default: vLLM's
        return render_messages(tokenizer, CHAT)
    return render_messages(tokenizer, CHAT, dialect=dialect)


@pytest.mark.parametrize(
    ("template", "dialect", "expected"),
    [
        (LLAMA3, None, VLLM_STRING),
        (LLAMA4, None, VLLM_PARTS),
        (QWEN2VL, None, VLLM_PARTS),
        (WITH_DEVELOPER, None, VLLM_WITH_DEVELOPER),
        (LLAMA3, SGLANG, SGLANG_STRING),
        (QWEN2VL, SGLANG, SGLANG_PARTS),
        (WITH_DEVELOPER, SGLANG, SGLANG_STRING),
    ],
)
def test_a_chat_is_rendered_as_the_engine_renders_it(
    tmp_path: Path, template: str, dialect: ChatDialect | None, expected: list[dict[str, Any]]
) -> None:
    assert _ours(tmp_path, template, dialect) == _hf_render(tmp_path, template, expected)


@pytest.mark.parametrize("dialect", [VLLM, SGLANG])
def test_the_builtin_chatml_renders_as_a_chatml_template_does(tmp_path: Path, dialect: ChatDialect) -> None:
    assert render_chat(CHAT, dialect=dialect) == _ours(tmp_path, CHATML, dialect)


def test_a_lone_leading_system_message_and_no_developer_are_left_as_they_are() -> None:
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert VLLM.messages(chat, "string", names_developer=False) == chat
    # A developer message alone becomes the one system message, first; an empty system text is left out.
    late = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    assert VLLM.messages(late, "string", names_developer=False) == [
        {"role": "system", "content": "d"},
        {"role": "user", "content": "u"},
    ]
    empty = [{"role": "system", "content": ""}, {"role": "developer", "content": "d"}]
    assert VLLM.messages(empty, "openai", names_developer=False) == [{"role": "system", "content": "d"}]


# Shapes of real templates that use what transformers' environment adds to Jinja's.
LLAMA31_DATE = (
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}"
    "{%- endif %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}<|eot_id|>"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
LOOP_CONTROLS = (
    "{%- for m in messages %}{%- if m['role'] == 'system' %}{% continue %}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{%- if loop.index > 3 %}{% break %}{% endif %}{%- endfor %}"
)
GENERATION = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{%- else %}{{ m['role'] }}: {{ m['content'] }}\n{%- endif %}{%- endfor %}"
)
TOJSON_OPTIONS = "{{ messages | tojson(indent=2, sort_keys=True) }}{{ {'<b>': '&'} | tojson }}"


@pytest.mark.parametrize("template", [LLAMA31_DATE, LOOP_CONTROLS, GENERATION, TOJSON_OPTIONS])
def test_templates_using_what_transformers_adds_to_jinja_render_as_transformers_renders_them(
    tmp_path: Path, template: str
) -> None:
    # strftime_now was missing: Llama 3.1's date fell back to "26 Jul 2024", unlike every engine's prompt;
    # {% break %} and {% generation %} did not load; tojson took no indent and escaped HTML.
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u <b>"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]  # fmt: skip
    directory = make_tokenizer_dir(tmp_path / "ours")
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert render_messages(load_tokenizer(directory), chat) == _hf_render(tmp_path, template, chat)


@pytest.mark.parametrize("dialect", [VLLM, SGLANG])
def test_the_builtin_chatml_prepares_messages_as_a_chatml_template_is_given_them(
    tmp_path: Path, dialect: ChatDialect
) -> None:
    # A system prompt opening with Claude Code's billing header (vLLM drops that line): the built-in ChatML
    # prepared the messages its own way unless a developer message was there, and kept the header that a
    # template is never given.
    chat = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nYou are brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    directory = make_tokenizer_dir(tmp_path / "chatml")
    config = {"chat_template": CHATML, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert render_chat(chat, dialect=dialect) == render_messages(
        load_tokenizer(directory), chat, dialect=dialect
    )


def test_every_part_type_vllm_reads_as_text_is_rendered_as_its_text() -> None:
    # The Responses API's input_text and output_text parts, a "thinking" part and a plain string part are
    # text to vLLM (MM_PARSER_MAP); it drops Claude Code's billing header line only from a system message's
    # strings and "text" parts. Expected: vLLM 0.32's parse_chat_messages of this chat, in both formats.
    header = "x-anthropic-billing-header: cch=1;"
    system = [
        {"type": "input_text", "text": header + "\nkept"},
        {"type": "text", "text": header + "\nBe brief."},
        header + "\nplain",
    ]
    user = [{"type": "input_text", "text": "a"}, "b", {"type": "thinking", "thinking": "c", "closed": True}]
    assistant = [{"type": "output_text", "text": "d"}, {"type": "refusal", "refusal": "e"}]
    tool = [{"type": "input_text", "text": "f"}, {"type": "output_text", "text": "g"}]
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": assistant},
        {"role": "tool", "content": tool, "tool_call_id": "t"},
    ]
    assert VLLM.messages(chat, "string", names_developer=False) == [
        {"role": "system", "content": header + "\nkept\nBe brief.\nplain"},
        {"role": "user", "content": "a\nb\nc"},
        {"role": "assistant", "content": "d\ne"},
        {"role": "tool", "content": "f\ng", "tool_call_id": "t"},
    ]
    texts = ([header + "\nkept", "Be brief.", "plain"], ["a", "b", "c"], ["d", "e"])
    parts = [[{"type": "text", "text": t} for t in group] for group in texts]
    assert VLLM.messages(chat, "openai", names_developer=False) == [
        {"role": "system", "content": parts[0]},
        {"role": "user", "content": parts[1]},
        {"role": "assistant", "content": parts[2]},
        {"role": "tool", "content": "f\ng", "tool_call_id": "t"},
    ]
