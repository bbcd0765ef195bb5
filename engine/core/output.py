"""The API side of an engine core's outputs (vLLM's OutputProcessor): the core sends token ids, this turns
them into text incrementally and looks for stop strings, which end a request here (the core is then told
to abort it; tokens it computed meanwhile are dropped, and usage counts only those up to the stop)."""

from __future__ import annotations

import dataclasses

from cache.tokens import Tokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_types import StepOutput
from engine.sequence import SamplingParams


class RequestOutputs:
    """One request's outputs as the API process hands them on: with text, ending at a stop string."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, params.stop, params.min_tokens)
        self.finished = False

    def process(self, out: StepOutput) -> StepOutput | None:
        """``out`` (token ids, no text) with its text; None once the request has finished here."""
        if self.finished:
            return None  # a token computed before the core heard of the stop string
        ids = out.token_ids
        # The core finishes with "stop" only on a stop token or EOS, whose text is never shown (as one
        # engine in one process does); "length" tokens are shown.
        shown = len(ids) - 1 if out.finish_reason == "stop" else len(ids)
        keep, reason = len(ids), out.finish_reason
        for i in range(shown):
            self._detok.add(ids[i])
            if self._detok.stopped:
                keep, reason = i + 1, "stop"
                break
        self.finished = reason is not None
        text = self._detok.take(final=self.finished)
        if keep == len(ids) and reason == out.finish_reason:
            return dataclasses.replace(out, text=text)
        return dataclasses.replace(
            out,
            text=text,
            token_ids=ids[:keep],
            finished=True,
            finish_reason=reason,
            completion_tokens=out.completion_tokens - (len(ids) - keep),
            logprobs=out.logprobs[:keep],
        )
