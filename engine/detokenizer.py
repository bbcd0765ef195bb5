"""Incremental detokenization with stop strings: text deltas as tokens arrive.

Decoding every token alone breaks multi-byte characters and merges; decoding the whole output every step
costs O(n) per token. As in vLLM, each step decodes a short window that starts a few tokens back and emits
only what is new. Text that could be the start of a stop string is held back until it is known not to be.
As in vLLM, stop strings are looked for only once more than ``min_tokens`` tokens are out, and only where
they end in new text.
"""

from __future__ import annotations

from cache.tokens import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text has been produced
        self.text = ""
        self._emitted = 0
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._min_tokens = min_tokens  # stop strings cannot end the text before more tokens than this are out
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Take one generated token; sets ``stopped`` (and cuts the text) when a stop string appears."""
        if self.stopped:
            return
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        window = self._tok.decode(self._ids[self._prefix :])
        if window.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the rest of the character
        delta = window[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        old = len(self.text)
        self.text += delta
        if len(self._ids) <= self._min_tokens:
            return
        # A stop string may straddle the old text's end; one that ended before (under min_tokens) stays.
        hits = [at for s in self.stop if (at := self.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _flush(self) -> None:
        """At the end, text still waiting for the rest of a character goes out as it is (with U+FFFD)."""
        if self._read < len(self._ids) and not self.stopped:
            before = self._tok.decode(self._ids[self._prefix : self._read])
            self.text += self._tok.decode(self._ids[self._prefix :])[len(before) :]
            self._prefix = self._read = len(self._ids)

    def take(self, final: bool = False) -> str:
        """Text not handed out yet: all of it when ``final``, else all but a possible stop-string start."""
        if final:
            self._flush()
        if final or self.stopped or not self.stop:
            end = len(self.text)
        else:
            end = max(self._emitted, len(self.text) - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
