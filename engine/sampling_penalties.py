"""What a request does to its logits before anything is drawn: logit_bias, banned tokens (min_tokens) and
the repetition, frequency and presence penalties, batched over the rows that use them.

The penalties need each sequence's token counts. Rebuilding them from the token lists every step would cost
O(prompt + output) Python work per row and step, so they live on the device in a pool: one row (slot) per
penalised sequence, its prompt's tokens marked once, each generated token counted as it is drawn. The
marks are floats and the penalties float arithmetic: on CPU boolean masks cost several float passes each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling_ops import Scratch


def add_bias(logits: torch.Tensor, rows: list[int], token_ids: list[int], biases: list[float]) -> None:
    """logits[rows[i], token_ids[i]] += biases[i] (OpenAI's logit_bias), in place."""
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)


def ban(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    """logits[rows[i], token_ids[i]] = -inf: those tokens cannot be drawn, greedy or not."""
    device = logits.device
    index = (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device))
    logits.index_put_(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=device))


class PenaltyPool:
    """Token counts of penalised sequences, on the device: ``counts[slot, t]`` is how often the sequence
    generated t, ``seen[slot, t]`` 1.0 if t is in its prompt or output (what the repetition penalty
    covers). Grows by doubling; freed slots are reused."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.seen = torch.zeros(0, vocab_size, device=device)
        self._free: list[int] = []

    @property
    def capacity(self) -> int:
        return self.counts.shape[0]

    def take(self, prompt: Sequence[int]) -> int:
        """A slot for a new sequence with this prompt."""
        if not self._free:
            old = self.capacity
            new = max(8, 2 * old)
            self.counts = torch.cat([self.counts, self.counts.new_zeros(new - old, self.vocab_size)])
            self.seen = torch.cat([self.seen, self.seen.new_zeros(new - old, self.vocab_size)])
            self._free.extend(range(new - 1, old - 1, -1))
        slot = self._free.pop()
        if prompt:
            self.seen[slot, torch.tensor(list(prompt), device=self.device)] = 1.0
        return slot

    def release(self, slot: int) -> None:
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self._free.append(slot)

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count one generated token per slot (``slots`` distinct)."""
        ones = torch.ones_like(slots, dtype=self.counts.dtype)
        self.counts.index_put_((slots, token_ids), ones, accumulate=True)
        self.seen.index_put_((slots, token_ids), ones)

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor | None,
        slots: torch.Tensor,
        penalties: torch.Tensor,
        *,
        repetition: bool,
        additive: bool,
        scratch: Scratch,
    ) -> None:
        """Penalise ``logits[rows]`` (None: every row) in place, as vLLM does: repetition first
        (transformers' rule: over the prompt and the output, a positive logit divided by it, a negative
        one multiplied), then OpenAI's ``logit -= frequency x count + presence x (count > 0)`` over the
        output. ``penalties`` [P, 3] holds each row's repetition, frequency and presence penalty; the flags
        say which kinds some row uses. In place or in ``scratch``: on CPU a fresh [P, V] tensor costs page
        faults worth more than the pass that fills it."""
        size = (slots.numel(), self.vocab_size, logits.device)
        x = logits if rows is None else torch.index_select(logits, 0, rows, out=scratch.get("rows", *size))
        if repetition:
            factor = torch.index_select(self.seen, 0, slots, out=scratch.get("pool", *size))
            factor.mul_(penalties[:, 0:1] - 1.0).add_(1.0)  # the penalty where seen, 1 elsewhere
            positive = torch.clamp(x, min=0.0, out=scratch.get("positive", *size))
            x.sub_(positive).mul_(factor).add_(positive.div_(factor))  # negative part x r, positive / r
        if additive:
            counts = torch.index_select(self.counts, 0, slots, out=scratch.get("pool", *size))
            x.addcmul_(counts, penalties[:, 1:2], value=-1.0)
            x.addcmul_(counts.clamp_(max=1.0), penalties[:, 2:3], value=-1.0)
        if rows is not None:
            logits.index_copy_(0, rows, x)
