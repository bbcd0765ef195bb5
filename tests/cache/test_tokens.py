"""Tokenizers and the chat template that feed the block hashes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.chat_dialect import ChatContentError
from cache.chat_template import TokenizerError, render_chat, render_messages
from cache.tokens import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.models import make_tokenizer_dir


def test_byte_tokenizer_round_trips() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids.dtype == np.uint32 and list(ids) == list("héllo".encode())
    assert tok.decode([*ids.tolist(), tok.eos_token_id]) == "héllo"


def test_hf_tokenizer_loads_from_a_model_directory(tmp_path: Path) -> None:
    tok = load_tokenizer(make_tokenizer_dir(tmp_path / "model"))
    ids = tok.encode("hello world")
    assert ids.dtype == np.uint32 and 0 < len(ids) < len("hello world")
    assert tok.decode(ids.tolist()) == "hello world"
    assert tok.eos_token_id == 2


def test_tokenizer_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_a_chat_continuation_extends_the_previous_prompt() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "hello!"}, {"role": "user", "content": "more"}]
    assert render_chat(second).startswith(render_chat(first) + "hello!")


def test_content_parts_and_unsupported_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert "<|im_start|>user\na\nb<|im_end|>" in render_chat(
        [{"role": "user", "content": parts}]
    )  # vLLM's "\n"
    with pytest.raises(ChatContentError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": [{"type": "text", "text": " hi "}]},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "again"},
]


def _with_template(directory: Path, template: str) -> Path:
    make_tokenizer_dir(directory)
    config = {"chat_template": template, "bos_token": "<s>", "eos_token": "<|im_end|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_a_chatml_template_renders_like_the_builtin(tmp_path: Path) -> None:
    tok = load_tokenizer(_with_template(tmp_path / "m", CHATML))
    assert tok.chat_template is not None
    assert render_messages(tok, MESSAGES) == render_chat(MESSAGES)


# Qwen-style: the jinja globals (namespace, range) and a loop over the messages in reverse.
WITH_GLOBALS = (
    "{%- set ns = namespace(last_user=0) %}{%- for i in range(messages|length) %}"
    "{%- if messages[i]['role'] == 'user' %}{%- set ns.last_user = i %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}"
    "{{ '*' if loop.index0 == ns.last_user }}\n{{ message['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


@pytest.mark.parametrize("template", [CHATML, LLAMA3_STYLE, WITH_GLOBALS])
def test_templates_render_as_transformers_renders_them(tmp_path: Path, template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    directory = _with_template(tmp_path / "m", template)
    ours = render_messages(load_tokenizer(directory), MESSAGES)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"), bos_token="<s>", eos_token="<|im_end|>"
    )
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else " hi "} for m in MESSAGES]
    expected = hf.apply_chat_template(
        plain, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert ours == expected


def test_a_template_that_raises_is_a_content_error(tmp_path: Path) -> None:
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    tok = load_tokenizer(_with_template(tmp_path / "m", template))
    with pytest.raises(ChatContentError, match="first must be user"):
        render_messages(tok, MESSAGES)


@pytest.fixture(scope="module")
def tiny_hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    tok = load_tokenizer(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))
    assert isinstance(tok, HFTokenizer) and tok._segments is not None
    return tok


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["system", "user", "assistant"]),
            st.text(st.characters(blacklist_categories=["Cs"]), max_size=400)
            | st.sampled_from(["the quick brown fox " * 30, " leading space and <|im_end|> inside " * 10]),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_segment_cached_encoding_equals_plain_encoding(
    tiny_hf_tokenizer: HFTokenizer, turns: list[tuple[str, str]]
) -> None:
    text = render_chat([{"role": r, "content": c} for r, c in turns])
    plain = tiny_hf_tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert tiny_hf_tokenizer.encode(text).tolist() == plain
    assert tiny_hf_tokenizer.encode(text).tolist() == plain  # again, from the cache


@pytest.mark.parametrize("special", [False, True])
def test_long_texts_encode_off_the_gil_to_the_same_ids(tiny_hf_tokenizer: HFTokenizer, special: bool) -> None:
    # Longer pieces go through encode_batch (which releases the GIL): the ids must not change,
    # with and without special tokens splitting the text into cached segments.
    body = "".join(f"word{i % 97} and some más text, {i}\n" for i in range(600))
    text = render_chat([{"role": "user", "content": body}]) if special else body
    plain = tiny_hf_tokenizer._tok.encode(text, add_special_tokens=False).ids
    assert len(body) > 4096
    assert tiny_hf_tokenizer.encode(text).tolist() == plain


def test_the_piece_cache_counts_each_entry_so_short_pieces_stay_bounded(
    tiny_hf_tokenizer: HFTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short pieces (role headers, user turns) are cached too; each entry is charged its own overhead, so a
    # stream of distinct short turns cannot grow the cache past its budget however short they are.
    import cache.tokens as tokens

    monkeypatch.setattr(tokens, "_CACHE_CHARS", 100 * (tokens._ENTRY_CHARS + 300))
    tiny_hf_tokenizer._cache.clear()
    tiny_hf_tokenizer._cached_chars = 0
    for i in range(1000):
        text = render_chat([{"role": "user", "content": f"turn {i:05d} " + "and so on " * 30}])
        assert tiny_hf_tokenizer.encode(text).tolist() == tiny_hf_tokenizer._tok.encode(text).ids
    assert ("", "assistant\n") in tiny_hf_tokenizer._cache  # the header every request repeats stays
    assert len(tiny_hf_tokenizer._cache) <= 100
    assert tiny_hf_tokenizer._cached_chars == sum(
        len(namespace) + len(piece) + tokens._ENTRY_CHARS for namespace, piece in tiny_hf_tokenizer._cache
    )
