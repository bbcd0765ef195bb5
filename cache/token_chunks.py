"""Where a long text may be cut so that its pieces tokenize to exactly the text's tokens.

Agents and chats resend the same growing text: a raw prompt, a document, a tool's output. Cut into chunks at
fixed places, every chunk but the last is one the tokenizer has seen before, so only the tail costs anything.

The cut must not change a single token. For byte-level BPE tokenizers that pre-tokenize with a left-to-right
regex split (GPT-2's built-in pattern; Llama 3's and Qwen 2's ``Split``), BPE merges never cross pre-tokens,
and every one of these patterns ends a pre-token between an ASCII letter and a space followed by an ASCII
letter (the letters' alternatives stop at the space; the space starts the next word: ``" ?\\p{L}+"`` or
``"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"``). Such a gap is therefore a pre-token boundary whatever surrounds it,
and the pattern restarted there finds the same pre-tokens as before. NFC normalisation cannot act across it
either (a space composes with nothing). Any other tokenizer (another pattern, another normaliser, a prefix
space, Metaspace / SentencePiece, truncation) is not cut: ``chunker_for`` returns None.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

CHUNK_CHARS = 2048  # cut at the first word gap this far past the previous cut

_WORD_GAP = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")

# The Split patterns known to end a pre-token at every word gap (exactly as tokenizer.json writes them).
_SPLIT_PATTERNS = frozenset(
    {
        # Llama 3 (and cl100k_base)
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        # Qwen 2 / 2.5 / 3
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


def split_chunks(text: str) -> list[str]:
    """``text`` cut at word gaps, each cut the first gap ``CHUNK_CHARS`` or more past the previous one. The
    cuts of a text are a prefix of the cuts of any longer text that starts with it (a cut depends only on
    the characters before it, and one is made only while two chunks' worth of text remain), so a growing
    text keeps its earlier chunks."""
    chunks: list[str] = []
    start = 0
    while len(text) - start >= 2 * CHUNK_CHARS:
        gap = _WORD_GAP.search(text, start + CHUNK_CHARS)
        if gap is None:
            break
        chunks.append(text[start : gap.start()])
        start = gap.start()
    chunks.append(text[start:])
    return chunks


def chunker_for(config: dict[str, Any]) -> Callable[[str], list[str]] | None:
    """``split_chunks`` when cutting at word gaps is exact for the tokenizer ``config`` (a parsed
    tokenizer.json), else None."""
    if config.get("normalizer") not in (None, {"type": "NFC"}):
        return None
    if config.get("truncation") is not None or config.get("padding") is not None:
        return None
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout"):
        return None
    if any(not token.get("special") for token in config.get("added_tokens") or []):
        return None  # non-special added tokens split text too, wherever they occur
    return split_chunks if _regex_pre_tokenizer(config.get("pre_tokenizer") or {}) else None


def _regex_pre_tokenizer(pre: dict[str, Any]) -> bool:
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space")
    if pre.get("type") != "Sequence":
        return False
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in _SPLIT_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space")
    )
