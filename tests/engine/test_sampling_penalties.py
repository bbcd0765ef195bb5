"""Penalties, logit_bias and the min_tokens ban change the logits exactly as transformers' logits processors
(repetition penalty, sequence bias, min new tokens) and OpenAI's documented formula (frequency and presence
penalties) do; logprobs are log_softmax of the logits as the model made them."""

from __future__ import annotations

from collections import Counter

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from engine.sampler import Sampler
from engine.sampling_ops import Scratch
from engine.sampling_penalties import PenaltyPool, add_bias, ban
from engine.sequence import SamplingParams, Sequence

VOCAB = 50
PROMPT = [3, 4, 4, 9, 17]
OUTPUT = [4, 20, 20, 20, 31, 9]


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def openai_penalties(x: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = x.clone()
    for token, count in Counter(output).items():
        out[..., token] -= count * frequency + presence
    return out


def pooled(prompt: list[int], output: list[int]) -> tuple[PenaltyPool, int]:
    pool = PenaltyPool(VOCAB, torch.device("cpu"))
    pool.take([1, 2])  # another sequence's slot: rows must not mix
    slot = pool.take(prompt)
    for token in output:
        pool.record(torch.tensor([slot]), torch.tensor([token]))
    return pool, slot


def penalise(
    x: torch.Tensor, prompt: list[int], output: list[int], rep: float, freq: float, pres: float
) -> torch.Tensor:
    pool, slot = pooled(prompt, output)
    out = x.clone()
    pool.apply(
        out,
        None,
        torch.tensor([slot]),
        torch.tensor([[rep, freq, pres]]),
        repetition=rep != 1.0,
        additive=bool(freq or pres),
        scratch=Scratch(),
    )
    return out


def test_repetition_penalty_is_transformers() -> None:
    x = logits()
    for rep in (1.3, 0.7, 2.0):
        ours = penalise(x, PROMPT, OUTPUT, rep, 0.0, 0.0)
        theirs = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([PROMPT + OUTPUT]), x.clone())
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)


def test_frequency_and_presence_penalties_are_openais_formula_over_the_output() -> None:
    x = logits()
    ours = penalise(x, PROMPT, OUTPUT, 1.0, 0.4, -0.7)
    assert torch.allclose(ours, openai_penalties(x, OUTPUT, 0.4, -0.7), atol=1e-6)
    assert ours[0, 3] == x[0, 3]  # a prompt-only token is not touched by them


def test_all_penalties_together_in_vllms_order() -> None:
    x = logits()
    repeated = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([PROMPT + OUTPUT]), x.clone())
    ours = penalise(x, PROMPT, OUTPUT, 1.2, 0.5, 0.25)
    assert torch.allclose(ours, openai_penalties(repeated, OUTPUT, 0.5, 0.25), atol=1e-5)


def test_a_released_slot_starts_clean() -> None:
    pool, slot = pooled(PROMPT, OUTPUT)
    pool.release(slot)
    assert pool.take([]) == slot and not pool.counts[slot].any() and not pool.seen[slot].any()


def test_logit_bias_is_a_single_token_sequence_bias() -> None:
    x = logits(2)
    ours = x.clone()
    add_bias(ours, [0, 0, 1], [5, 7, 5], [100.0, -2.5, -100.0])
    first = SequenceBiasLogitsProcessor([[[5], 100.0], [[7], -2.5]])
    second = SequenceBiasLogitsProcessor([[[5], -100.0]])
    ids = torch.tensor([[1, 2]])
    assert torch.allclose(ours[0:1], first(ids, x[0:1].clone())) and torch.allclose(
        ours[1:], second(ids, x[1:].clone())
    )


def test_the_min_tokens_ban_is_transformers_min_new_tokens() -> None:
    x = logits()
    ours = x.clone()
    ban(ours, [0, 0], [2, 11])
    theirs = MinNewTokensLengthLogitsProcessor(3, 4, [2, 11])(torch.tensor([[1, 1, 1, 5]]), x.clone())
    assert torch.equal(ours, theirs)


def seq(request_id: str, params: SamplingParams, prompt: list[int] = PROMPT) -> Sequence:
    return Sequence(request_id, list(prompt), params, 0)


def step(sampler: Sampler, x: torch.Tensor, seqs: list[Sequence], eos: tuple[int, ...] = ()) -> list[int]:
    """One engine step (every sequence's logits ``x``): sample, then append each token to its sequence."""
    out = sampler.sample(x.expand(len(seqs), -1).clone(), seqs, eos)
    for s, t in zip(seqs, out.token_ids, strict=True):
        s.token_ids.append(t)
    return out.token_ids


def test_the_sampler_counts_what_it_draws() -> None:
    sampler = Sampler(VOCAB)
    s = seq("a", SamplingParams(temperature=1.0, presence_penalty=0.1, seed=3))
    for _ in range(12):
        step(sampler, logits(), [s])
    pool = sampler._pool
    assert pool is not None
    slot = sampler._states["a"].slot
    assert slot is not None
    expected = torch.bincount(torch.tensor(s.output_token_ids), minlength=VOCAB).float()
    assert torch.equal(pool.counts[slot], expected)
    seen = torch.bincount(torch.tensor(s.token_ids), minlength=VOCAB) > 0  # prompt and output
    assert torch.equal(pool.seen[slot] > 0, seen)


def test_penalties_steer_greedy_away_from_repeating() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 7], x[0, 3] = 5.0, 1.0
    plain = seq("plain", SamplingParams(temperature=0.0))
    frequency = seq("freq", SamplingParams(temperature=0.0, frequency_penalty=2.0))
    repetition = seq("rep", SamplingParams(temperature=0.0, repetition_penalty=10.0), prompt=[7])
    sampler = Sampler(VOCAB)
    outs = [step(sampler, x, [plain, frequency, repetition]) for _ in range(4)]
    assert [o[0] for o in outs] == [7, 7, 7, 7]
    # 5 - 2 x count: 5, 3, then 1 ties token 3 (the argmax takes the lower id), whose own count then sinks it.
    assert [o[1] for o in outs] == [7, 7, 3, 7]
    # 7 is in the prompt: 5 / 10 < 1, so token 3 first; once generated it weighs 1 / 10 < 0.5.
    assert [o[2] for o in outs] == [3, 7, 7, 7]


def test_logit_bias_bans_and_forces_tokens_and_logprobs_stay_raw() -> None:
    x = logits()
    best = int(x.argmax())
    sampler = Sampler(VOCAB)
    banned = seq("ban", SamplingParams(temperature=0.0, logit_bias=((best, -100.0),), logprobs=3))
    forced = seq("force", SamplingParams(temperature=1.0, logit_bias=((13, 100.0),), logprobs=0, seed=1))
    out = sampler.sample(x.expand(2, -1).clone(), [banned, forced])
    assert out.token_ids[0] != best and out.token_ids[1] == 13
    raw = torch.log_softmax(x[0], dim=-1)
    lp_banned, lp_forced = out.logprobs
    assert lp_banned is not None and lp_forced is not None
    assert lp_banned.logprob == raw[out.token_ids[0]].item() and lp_forced.logprob == raw[13].item()
    top = torch.topk(raw, 3)
    assert lp_banned.top == tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
    assert lp_banned.top[0][0] == best  # the banned token is still the model's favourite
    assert lp_forced.top == ()


def test_min_tokens_holds_eos_and_stop_tokens_off() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 2] = 10.0  # EOS, by far the likeliest
    x[0, 8] = 9.0  # a stop token, next
    sampler = Sampler(VOCAB)
    s = seq("m", SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(8,)))
    ignoring = seq("i", SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True))
    drawn = [step(sampler, x, [s, ignoring], eos=(2,)) for _ in range(4)]
    assert [d[0] for d in drawn] == [0, 0, 0, 2]  # both held off for 3 tokens (token 0: first of the rest)
    assert [d[1] for d in drawn] == [2, 2, 2, 2]  # with ignore_eos EOS is an ordinary token: not held off


def test_a_seeded_row_draws_the_same_whatever_its_companions() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.9, min_p=0.01, presence_penalty=0.3, seed=42)
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=3, logprobs=2),
        SamplingParams(temperature=0.5, repetition_penalty=1.5, logit_bias=((1, 5.0),)),
    ]

    def run(with_companions: bool) -> list[int]:
        sampler = Sampler(VOCAB)
        ours = seq("ours", params)
        others = [seq(f"o{i}", p) for i, p in enumerate(companions)] if with_companions else []
        got = []
        for i in range(20):
            batch = [*others[: i % 4], ours, *others[i % 4 :]]  # it moves around the batch too
            x = logits(1, seed=100 + i)
            got.append(step(sampler, x, batch)[batch.index(ours)])
        return got

    assert run(False) == run(True)
