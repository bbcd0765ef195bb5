"""The batched sampler's draws follow exactly the distribution transformers' logits warpers define
(temperature, min_p, top_k, top_p, in vLLM's order), and the host sampler it replaced agrees with it.

The random stream is not the old one (per-sequence uniforms instead of torch.multinomial with a
torch.Generator), so for a fixed seed the tokens differ from the old sampler's: what is asserted is that
greedy gives identical tokens and that both samplers draw from the same distribution, each within 5 sigma
of the exact probabilities on every token.
"""

from __future__ import annotations

from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampler import Sampler
from engine.sampling_ops import (
    BLOCK,
    CANDIDATES,
    UNIFORMS_PER_ROW,
    block_sums,
    draw,
    inverse_cdf,
    mass_above,
    row_argmax,
    top_logprobs,
    top_p_sorted,
)
from engine.sequence import SamplingParams, Sequence

VOCAB = 600  # several blocks, the last one short
DRAWS = 40_000


def lm_logits(vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * 2.5


def expected(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The exact next-token distribution by transformers' warpers, in vLLM's order."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(p.temperature)])
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    scores = warpers(cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long)), logits.unsqueeze(0).clone())
    return torch.softmax(scores, dim=-1)[0]


def table(p: SamplingParams, rows: int, seed: int = 1) -> torch.Tensor:
    u = torch.rand(rows, UNIFORMS_PER_ROW, generator=torch.Generator().manual_seed(seed))
    head = torch.tensor([p.temperature, p.top_k, p.top_p, p.min_p]).expand(rows, 4)
    return torch.cat([head, u], dim=1)


def batched_draw(logits: torch.Tensor, p: SamplingParams, rows: int) -> torch.Tensor:
    return draw(
        logits.expand(rows, -1).contiguous(),
        table(p, rows),
        scale=p.temperature != 1.0,
        k_max=p.top_k,
        use_min_p=p.min_p > 0,
        top_p_rows=torch.arange(rows) if p.top_p < 1 else None,
    )


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Every token's frequency within 5 sigma of its probability; nothing outside the support."""
    n = tokens.numel()
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / n
    probs = probs.double()
    assert freq[probs == 0].sum() == 0, "drew a token the warpers filter out"
    sigma = (probs * (1 - probs) / n).sqrt()
    worst = ((freq - probs).abs() - 5 * sigma).max()
    assert worst <= 1e-4, f"a frequency is {worst:.2e} beyond 5 sigma"


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=20),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, top_p=0.9, top_k=50, min_p=0.02),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=2.0, top_p=0.05),  # flat and narrow: most rows end in the sort fallback
]


def case_id(p: SamplingParams) -> str:
    return f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}"


@pytest.mark.parametrize("params", CASES, ids=case_id)
def test_draws_follow_the_warpers_distribution(params: SamplingParams) -> None:
    logits = lm_logits()
    assert_follows(batched_draw(logits, params, DRAWS), expected(logits, params))


def old_host_sample(logits: torch.Tensor, p: SamplingParams, g: torch.Generator) -> int:
    """The sampler this one replaced (engine/sampler.py before), row by row on the host."""
    if p.greedy:
        return int(logits.argmax())
    scores = logits / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=g))


@pytest.mark.parametrize("params", CASES[:4], ids=case_id)
def test_the_old_host_sampler_draws_from_the_same_distribution(params: SamplingParams) -> None:
    logits = lm_logits(seed=3)
    probs = expected(logits, params)
    g = torch.Generator().manual_seed(0)
    old = torch.tensor([old_host_sample(logits, params, g) for _ in range(8000)])
    assert_follows(old, probs)
    assert_follows(batched_draw(logits, params, 8000), probs)


def test_greedy_gives_the_old_samplers_tokens() -> None:
    logits = torch.randn(64, 5000, generator=torch.Generator().manual_seed(5)) * 3
    seqs = [Sequence(f"s{i}", [1], SamplingParams(temperature=0.0), 0) for i in range(64)]
    new = Sampler(5000).sample(logits.clone(), seqs).token_ids
    g = torch.Generator()
    assert new == [old_host_sample(row, SamplingParams(temperature=0.0), g) for row in logits]


@pytest.mark.parametrize("vocab", [BLOCK * 64, BLOCK * 64 + 37, 151_936, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_argmax_is_torchs_argmax(vocab: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = (torch.randn(32, vocab, generator=g) * 4).to(dtype)
    x[1] = 7.0  # a row of ties: the first index wins
    x[2, -3:] = 1e4  # the maximum in the ids past the last whole block, tied with itself
    x[3, 5], x[3, -1] = 1e4, 1e4  # a tie between the first block and the tail
    x[4] = float("-inf")  # every id banned
    x[5, vocab // 2], x[5, 3] = float("nan"), float("nan")  # NaN counts as the maximum, the first one
    x[6, -1] = float("nan")  # ... in the tail too
    x[7, vocab // 3] = float("inf")
    expected = x.argmax(dim=-1)
    assert torch.equal(row_argmax(x), expected)
    assert torch.equal(row_argmax(x[::2]), expected[::2])  # rows not adjacent in memory
    assert torch.equal(row_argmax(x[:, : vocab - 1]), x[:, : vocab - 1].argmax(dim=-1))  # a strided view


def test_the_kept_top_p_set_is_transformers() -> None:
    for seed in range(20):
        logits = lm_logits(seed=seed)
        for top_p in (0.3, 0.75, 0.95):
            probs = torch.softmax(logits, dim=-1)
            sorted_p, order = torch.sort(probs, descending=True)
            kept = torch.zeros_like(probs).scatter(
                0, order, top_p_sorted(sorted_p.unsqueeze(0), torch.tensor([[top_p]]))[0]
            )
            hf = TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), logits.unsqueeze(0).clone())[0]
            assert torch.equal(kept > 0, hf > float("-inf"))


def test_mass_above_is_the_mass_of_the_heavier_tokens() -> None:
    p = torch.rand(8, 1000, generator=torch.Generator().manual_seed(2))
    b = p[:, 17:18]
    assert torch.allclose(mass_above(p, b), torch.where(p > b, p, 0.0).sum(-1, keepdim=True), rtol=1e-5)


def test_inverse_cdf_never_draws_a_token_without_weight() -> None:
    vocab = 3 * BLOCK + 5
    p = torch.zeros(4, vocab)
    p[0, 0] = 1.0  # first token only
    p[1, vocab - 1] = 1.0  # last token, in the short block
    p[2, [BLOCK - 1, BLOCK, 2 * BLOCK + 7]] = torch.tensor([1.0, 2.0, 1.0])
    p[3] = 1.0
    u = torch.tensor([0.0, 0.5, 1.0 - 2**-24, 1.0]).view(1, 4).expand(4, 4)  # 1.0: float32 rounding of u
    drawn = inverse_cdf(p, block_sums(p), u.contiguous())
    assert (drawn[0] == 0).all() and (drawn[1] == vocab - 1).all()
    assert drawn[2].tolist() == [BLOCK - 1, BLOCK, 2 * BLOCK + 7, 2 * BLOCK + 7]
    assert drawn[3].tolist() == [0, vocab // 2, vocab - 1, vocab - 1]
    rows = torch.tensor([2, 0])  # reading rows in place gives what copying them out does
    assert torch.equal(inverse_cdf(p, block_sums(p), u[:2].contiguous(), rows), drawn[[2, 0]])


def test_a_row_rejecting_every_candidate_falls_back_to_the_sort() -> None:
    logits = torch.zeros(1, 50)
    logits[0, 7] = 0.1  # slightly likelier than the 49 others: top_p 0.01 keeps token 7 only
    u = torch.full((1, UNIFORMS_PER_ROW), 0.999)  # every candidate is the last token, never token 7
    t = torch.cat([torch.tensor([[1.0, 0.0, 0.01, 0.0]]), u], dim=1)
    assert CANDIDATES > 1
    assert draw(logits, t, scale=False, k_max=0, use_min_p=False, top_p_rows=torch.tensor([0])).tolist() == [
        7
    ]


def test_top_logprobs_pack_the_chosen_and_the_best() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    lp = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor([5, 0, 39])
    packed = top_logprobs(lp, chosen, 4)
    top = torch.topk(lp, 4)
    assert torch.equal(packed[:, 0], lp[[0, 1, 2], chosen])
    assert torch.equal(packed[:, 1:5], top.values) and torch.equal(packed[:, 5:].long(), top.indices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_logits_stay_there_and_agree_with_the_cpu() -> None:
    logits = lm_logits()
    params = SamplingParams(temperature=1.3, top_p=0.9, top_k=50, min_p=0.02)
    on_gpu = draw(
        logits.cuda().expand(DRAWS, -1).contiguous(),
        table(params, DRAWS).cuda(),
        scale=True,
        k_max=50,
        use_min_p=True,
        top_p_rows=torch.arange(DRAWS, device="cuda"),
    )
    assert on_gpu.is_cuda
    assert_follows(on_gpu.cpu(), expected(logits, params))
    batch = torch.randn(16, 3000, generator=torch.Generator().manual_seed(8)) * 3
    mixed = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=((9, 2.0),)
        ),
    ]
    seqs = [Sequence(f"s{i}", [1, 2, 9], mixed[i % 2], 0) for i in range(16)]
    cpu, gpu = Sampler(3000), Sampler(3000)
    for _ in range(3):
        a = cpu.sample(batch.clone(), seqs)
        b = gpu.sample(batch.cuda(), seqs)
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4) and [t for t, _ in x.top] == [
                    t for t, _ in y.top
                ]
        for s, t in zip(seqs, a.token_ids, strict=True):
            s.token_ids.append(t)
