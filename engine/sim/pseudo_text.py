"""The simulated engine's answers: deterministic pseudo-text, cut at the request's stop strings."""

from __future__ import annotations

import random

import xxhash

from engine.openai_api import FinishReason

_WORDS = (
    "the", "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "cache", "block",
    "token", "prefix", "model", "gateway", "engine", "region", "latency", "memory", "request", "stream",
    "batch", "kernel", "layer", "hash", "route", "edge", "query", "answer", "value", "key", "time",
    "simple", "fast", "small", "large", "every", "some", "many", "this", "we", "they", "can", "will",
)  # fmt: skip


def _build_tape(size: int = 1 << 16) -> tuple[str, tuple[int, ...]]:
    """A fixed ASCII text of words and sentences, and the offsets where its words start.

    A request's output is a slice of it starting at a word picked by its seed: O(1) per request instead
    of drawing words one by one.
    """
    rng = random.Random(0x6B76676174)
    parts: list[str] = []
    starts: list[int] = []
    pos = 0
    capital = True
    while pos < size:
        word = rng.choice(_WORDS)
        if capital:
            word = word.capitalize()
        capital = rng.random() < 0.1
        text = word + (". " if capital else " ")
        starts.append(pos)
        parts.append(text)
        pos += len(text)
    return "".join(parts), tuple(starts)


_TAPE, _WORD_STARTS = _build_tape()


def pseudo_text(seed: int, length: int) -> str:
    """``length`` ASCII characters of deterministic pseudo-text, the same for the same ``seed``."""
    mixed = xxhash.xxh3_64_intdigest((seed & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
    start = _WORD_STARTS[mixed % len(_WORD_STARTS)]
    text = _TAPE[start : start + length]
    while len(text) < length:  # longer than what is left of the tape: wrap around
        text += _TAPE[: length - len(text)]
    return text


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, FinishReason]:
    """``text`` up to (not including) the earliest stop string, and why generation ended."""
    cut = -1
    for s in stop:
        i = text.find(s)
        if i >= 0 and (cut < 0 or i < cut):
            cut = i
    return (text, "length") if cut < 0 else (text[:cut], "stop")
