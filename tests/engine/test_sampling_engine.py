"""Every sampling parameter has its effect through the real engine (a tiny random model, no HTTP)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.engine_types import StepOutput
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(str(tiny_model_dir), block_size=4, num_kv_blocks=512, device="cpu"))


def prompt(e: LLMEngine, n: int = 9, salt: int = 0) -> list[int]:
    vocab = e.model_config.vocab_size
    return [(11 * j + 5 + salt) % (vocab - 10) + 10 for j in range(n)]


def run(e: LLMEngine, params: SamplingParams, ids: list[int] | None = None) -> list[StepOutput]:
    e.add_request("r", ids or prompt(e), params)
    outs = []
    while e.has_work():
        outs.extend(e.step())
    return outs


def eos(e: LLMEngine) -> int:
    return int(min(e.eos_token_ids))


def test_ignore_eos_runs_to_max_tokens_where_eos_would_stop_at_once(engine: LLMEngine) -> None:
    forced = ((eos(engine), 100.0),)  # the model's first choice is now EOS, every step
    stopped = run(engine, SamplingParams(max_tokens=6, temperature=0.0, logit_bias=forced))
    assert (stopped[-1].finish_reason, stopped[-1].completion_tokens) == ("stop", 1)
    ignored = run(engine, SamplingParams(max_tokens=6, temperature=0.0, logit_bias=forced, ignore_eos=True))
    assert (ignored[-1].finish_reason, ignored[-1].completion_tokens) == ("length", 6)
    assert all(o.token_ids == (eos(engine),) for o in ignored)


def test_min_tokens_holds_eos_off(engine: LLMEngine) -> None:
    forced = ((eos(engine), 100.0),)
    outs = run(
        engine, SamplingParams(max_tokens=10, temperature=0.8, seed=1, logit_bias=forced, min_tokens=4)
    )
    tokens = [t for o in outs for t in o.token_ids]
    assert len(tokens) == 5 and eos(engine) not in tokens[:4] and tokens[4] == eos(engine)
    assert outs[-1].finish_reason == "stop"


def test_stop_token_ids_end_the_answer_without_their_text(engine: LLMEngine) -> None:
    greedy = [
        t
        for o in run(engine, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
        for t in o.token_ids
    ]
    stop_at = greedy[2]
    outs = run(
        engine, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,))
    )
    tokens = [t for o in outs for t in o.token_ids]
    assert tokens == greedy[: greedy.index(stop_at) + 1] and outs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(tokens[:-1])


def test_logit_bias_bans_and_forces(engine: LLMEngine) -> None:
    first = run(engine, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    banned = run(engine, SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((first, -100.0),)))
    assert banned[0].token_ids[0] != first
    forced = run(
        engine, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, logit_bias=((77, 100.0),))
    )
    assert [t for o in forced for t in o.token_ids] == [77] * 4


def test_penalties_stop_greedy_repeating_a_favoured_token(engine: LLMEngine) -> None:
    # The tiny model's logits lie within +-0.5: a bias of 1 makes token 77 greedy's choice at every step.
    base = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias=((77, 1.0),))
    assert [t for o in run(engine, base) for t in o.token_ids] == [77] * 6
    for penalised in (
        replace(base, presence_penalty=2.0),
        replace(base, frequency_penalty=2.0),
        replace(base, repetition_penalty=5.0),
    ):
        tokens = [t for o in run(engine, penalised) for t in o.token_ids]
        assert tokens[0] == 77 and tokens[1] != 77, penalised  # penalised once it has been generated


def test_logprobs_are_log_softmax_of_the_models_logits(engine: LLMEngine) -> None:
    seen: list[torch.Tensor] = []
    run_model = engine.runner.run

    def recording(batch):  # type: ignore[no-untyped-def]
        logits = run_model(batch)
        seen.append(logits.clone())
        return logits

    engine.runner.run = recording  # type: ignore[method-assign]
    try:
        params = SamplingParams(
            max_tokens=4, temperature=1.0, seed=3, ignore_eos=True, logprobs=5, repetition_penalty=1.3
        )
        outs = run(engine, params)
    finally:
        engine.runner.run = run_model  # type: ignore[method-assign]
    assert len(outs) == len(seen) == 4
    for out, logits in zip(outs, seen, strict=True):
        raw = torch.log_softmax(logits[0], dim=-1)
        [lp] = out.logprobs
        assert lp.token_id == out.token_ids[0] and lp.logprob == pytest.approx(
            raw[lp.token_id].item(), abs=1e-5
        )
        top = torch.topk(raw, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert all(o.logprobs == () for o in run(engine, SamplingParams(max_tokens=2, temperature=0.0)))


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch(engine: LLMEngine) -> None:
    params = SamplingParams(
        max_tokens=12,
        temperature=1.1,
        top_p=0.9,
        top_k=40,
        min_p=0.01,
        seed=2024,
        ignore_eos=True,
        presence_penalty=0.5,
    )
    alone = engine.generate([prompt(engine)], params)[0]
    companions = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=1.0, logprobs=3, ignore_eos=True),
        SamplingParams(
            max_tokens=9, temperature=0.7, frequency_penalty=1.0, logit_bias=((50, 3.0),), ignore_eos=True
        ),
    ]
    prompts = [
        prompt(engine, 5, salt=1),
        prompt(engine),
        prompt(engine, 14, salt=2),
        prompt(engine, 7, salt=3),
    ]
    batched = engine.generate(prompts, [companions[0], params, companions[1], companions[2]])[1]
    assert batched == alone
    assert engine.generate([prompt(engine)], replace(params, seed=2025))[0] != alone


def test_finished_requests_leave_no_sampler_state(engine: LLMEngine) -> None:
    run(engine, SamplingParams(max_tokens=3, temperature=1.0, presence_penalty=1.0))
    assert not engine.sampler._states
    pool = engine.sampler._pool
    assert pool is not None and not pool.counts.any() and not pool.seen.any()
