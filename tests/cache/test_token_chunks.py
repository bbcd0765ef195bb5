"""Chunked encoding of long texts (cache.token_chunks) gives exactly the tokenizer's own ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from cache.token_chunks import _WORD_GAP, CHUNK_CHARS, chunker_for, split_chunks
from cache.tokens import HFTokenizer

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
WORDS = ["the", "Quick", "brown", "fox's", "don't", "naïve", "café", "e\u0301t\u0301e", "中文字", "Ωmega",
         "x", "I", "12345", "3.14", "...", "(see)", "--", "#tag", "'ll", "\t", "a1b2", "OK!"]  # fmt: skip
SEPARATORS = [" ", " ", " ", "  ", "\n", "\n\n", " \n", "  \n", "\n  ", " \t ", "", ", ", ".\n"]


def corpus() -> list[str]:
    return [" ".join(WORDS[i:] + WORDS[:i]) + sep for i in range(len(WORDS)) for sep in SEPARATORS]


def save(tok: Tokenizer, directory: Path) -> HFTokenizer:
    tok.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=700, special_tokens=["<|im_end|>"]))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return HFTokenizer(directory / "tokenizer.json")


def gpt2_style(directory: Path) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return save(tok, directory)


def split_style(directory: Path, pattern: str, nfc: bool) -> HFTokenizer:
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return save(tok, directory)


@pytest.fixture(scope="module")
def chunked(tmp_path_factory: pytest.TempPathFactory) -> list[HFTokenizer]:
    root = tmp_path_factory.mktemp("chunk-tokenizers")
    toks = [gpt2_style(root / "gpt2"), split_style(root / "llama3", LLAMA3, False),
            split_style(root / "qwen2", QWEN2, True)]  # fmt: skip
    assert all(t._chunker is not None for t in toks)
    return toks


# Random words and separators, repeated to three chunks' worth or more, so that every example is cut.
texts = (
    st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPARATORS)), min_size=1, max_size=400)
    .map(lambda pairs: "".join(w + s for w, s in pairs))
    .map(lambda t: t * (1 + 3 * CHUNK_CHARS // len(t)))
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, extra=texts)
def test_chunked_encoding_equals_the_tokenizers_own(
    chunked: list[HFTokenizer], text: str, extra: str
) -> None:
    for tok in chunked:
        for t in (text, text + extra):  # the second extends the first: its earlier chunks come from the cache
            assert tok.encode(t).tolist() == tok._tok.encode(t, add_special_tokens=False).ids


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pairs=st.lists(st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPARATORS)), min_size=2, max_size=120)
)
def test_every_word_gap_is_a_token_boundary(chunked: list[HFTokenizer], pairs: list[tuple[str, str]]) -> None:
    # The rule itself, at every place it allows a cut (not only where split_chunks happens to cut).
    text = "".join(w + s for w, s in pairs)
    for tok in chunked:
        whole = tok._tok.encode(text, add_special_tokens=False).ids
        for gap in _WORD_GAP.finditer(text):
            head, tail = text[: gap.start()], text[gap.start() :]
            assert tok._tok.encode(head).ids + tok._tok.encode(tail).ids == whole, (head[-20:], tail[:20])


def test_a_growing_text_keeps_its_chunks() -> None:
    text = " ".join(f"word{i % 7}x" for i in range(3000))
    grown = text + " and more words at the end"
    short, long = split_chunks(text), split_chunks(grown)
    assert len(short) >= 3 and all(len(c) >= CHUNK_CHARS for c in short[:-1])
    assert long[: len(short) - 1] == short[:-1]
    assert "".join(short) == text and "".join(long) == grown


def test_the_cache_serves_the_earlier_chunks(chunked: list[HFTokenizer]) -> None:
    tok = chunked[0]
    text = " ".join(f"brown{i}fox the quick" for i in range(1200))
    tok.encode(text)
    first = split_chunks(text)[0]
    assert ("", first) in tok._cache  # what the next, longer request reuses
    assert tok.encode(text + " Quick").tolist() == tok._tok.encode(text + " Quick").ids


@pytest.mark.parametrize(
    "pre",
    [
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # one pre-token: merges may cross
        pre_tokenizers.ByteLevel(add_prefix_space=True),
        pre_tokenizers.Metaspace(),
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(r"\s+"), behavior="isolated"),
                pre_tokenizers.ByteLevel(use_regex=False),
            ]
        ),
    ],
)
def test_tokenizers_where_a_cut_could_change_tokens_are_not_cut(pre: pre_tokenizers.PreTokenizer) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    assert chunker_for(json.loads(tok.to_str())) is None


def test_other_normalisers_and_truncation_are_not_cut() -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    assert chunker_for(json.loads(tok.to_str())) is not None
    tok.normalizer = normalizers.Lowercase()
    assert chunker_for(json.loads(tok.to_str())) is None
    tok.normalizer = None
    tok.enable_truncation(512)
    assert chunker_for(json.loads(tok.to_str())) is None
