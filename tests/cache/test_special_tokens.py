"""The special tokens a tokenizer's post-processor adds around a text (Llama's BOS), as Hugging Face's
``add_special_tokens=True`` adds them: how vLLM and SGLang encode a completion's text prompt."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as HFRaw

from cache.tokens import load_tokenizer
from tests.models import make_bos_tokenizer_dir, make_tokenizer_dir

TEXTS = ["the quick brown fox", "hello kvgate <s> world", "", "x" * 600 + " hello world " * 40]


@pytest.mark.parametrize("single", ["<s> $A", "$A </s>", "<s> $A </s>", None])
def test_special_tokens_are_added_around_a_text_as_hugging_face_adds_them(
    tmp_path: Path, single: str | None
) -> None:
    directory = (
        make_tokenizer_dir(tmp_path / "m")
        if single is None
        else make_bos_tokenizer_dir(tmp_path / "m", single=single)
    )
    ours, theirs = load_tokenizer(directory), HFRaw.from_file(str(directory / "tokenizer.json"))
    for text in TEXTS:
        expected = theirs.encode(text, add_special_tokens=True).ids
        assert ours.with_special_tokens(ours.encode(text)).tolist() == expected, (single, text[:40])
        assert ours.encode(text).tolist() == theirs.encode(text, add_special_tokens=False).ids


def test_the_byte_tokenizer_adds_nothing() -> None:
    ids = np.arange(5, dtype=np.uint32)
    assert load_tokenizer(None).with_special_tokens(ids) is ids
