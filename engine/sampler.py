"""Next-token sampling: greedy, temperature, top-k, top-p, with a generator per sequence.

Each sequence draws from its own ``torch.Generator``: with a seed, the same request gives the same output
whatever else shares its batch.
"""

from __future__ import annotations

import torch

from engine.sequence import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % 2**63)
    return generator


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (float32)."""
    out = []
    greedy = logits.argmax(dim=-1).tolist()
    for row, p, g, best in zip(logits, params, generators, greedy, strict=True):
        if p.greedy:
            out.append(int(best))
            continue
        scores = row / p.temperature
        if 0 < p.top_k < scores.shape[-1]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest set whose mass reaches top_p (the first token always stays).
            drop = cumulative - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        out.append(int(torch.multinomial(probs, 1, generator=g)))
    return out
