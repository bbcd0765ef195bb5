"""Tokenizers and the chat template that feed the block hashes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cache.tokens import ByteTokenizer, ChatContentError, TokenizerError, load_tokenizer, render_chat
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
    assert "ab" in render_chat([{"role": "user", "content": parts}])
    with pytest.raises(ChatContentError, match="image_url"):
        render_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
