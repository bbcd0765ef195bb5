"""The engine cost model: the step-time formula, FIFO admission, chunked prefill, queueing, KV capacity,
named profiles and overrides, determinism. Pure Python, no project imports besides ``perfmodel``."""

from __future__ import annotations

import itertools
import math

import pytest

from perfmodel import (
    PROFILES,
    BatchingEngine,
    EngineProfile,
    kv_tokens_needed,
    parse_overrides,
    prefill_throughput_tokens_per_s,
    profile,
    profile_names,
    step_time_s,
    with_overrides,
)

# Round numbers, so that the formula's values can be written down.
SIMPLE = EngineProfile(
    step_fixed_s=0.010,
    prefill_s_per_token=0.001,
    decode_s_per_seq=0.002,
    cached_read_s_per_token=0.0001,
    max_batch_tokens=100,
    max_running=4,
    kv_capacity_tokens=10_000,
    block_size=16,
)


# ---- the formula -----------------------------------------------------------------------------------------


def test_step_time_is_the_configured_linear_formula() -> None:
    assert step_time_s(SIMPLE, 0, 0) == pytest.approx(0.010)
    assert step_time_s(SIMPLE, 50, 0) == pytest.approx(0.010 + 50 * 0.001)
    assert step_time_s(SIMPLE, 0, 3) == pytest.approx(0.010 + 3 * 0.002)
    assert step_time_s(SIMPLE, 50, 3, 200) == pytest.approx(0.010 + 0.050 + 0.006 + 0.020)


def test_step_time_grows_with_prefill_tokens_and_decode_seqs_at_the_configured_rates() -> None:
    for p in (SIMPLE, profile("llama3-8b-h100"), profile("llama3-70b-h100")):
        prefill = [step_time_s(p, n, 0) for n in range(0, 8193, 512)]
        assert all(
            b - a == pytest.approx(512 * p.prefill_s_per_token) for a, b in itertools.pairwise(prefill)
        )
        decode = [step_time_s(p, 0, n) for n in range(0, 257, 16)]
        assert all(b - a == pytest.approx(16 * p.decode_s_per_seq) for a, b in itertools.pairwise(decode))


def test_engine_steps_cost_what_the_formula_says() -> None:
    engine = BatchingEngine(SIMPLE)
    engine.submit("a", 0.0, prompt_tokens=40, cached_tokens=10, output_tokens=3)
    first = engine.step()
    assert first is not None
    assert (first.prefill_tokens, first.decode_seqs, first.cached_tokens_read) == (30, 0, 10)
    assert first.duration_s == step_time_s(SIMPLE, 30, 0, 10)
    assert first.end_s - first.start_s == pytest.approx(first.duration_s)
    assert first.first_tokens == ("a",)
    second = engine.step()
    assert second is not None
    assert (second.prefill_tokens, second.decode_seqs, second.cached_tokens_read) == (0, 1, 0)
    assert second.duration_s == step_time_s(SIMPLE, 0, 1)
    result = engine.result("a")
    assert result.first_token_s == first.end_s
    engine.run_to_completion()
    result = engine.result("a")
    # three output tokens: one from the prefill, two decode steps
    assert result.finish_s == pytest.approx(first.end_s + 2 * step_time_s(SIMPLE, 0, 1))
    assert engine.idle() and engine.kv_used_tokens == 0 and engine.queued_prefill_tokens == 0


def test_a_fully_cached_prompt_still_computes_one_token() -> None:
    engine = BatchingEngine(SIMPLE)
    engine.submit("a", 0.0, prompt_tokens=64, cached_tokens=64, output_tokens=1)
    record = engine.step()
    assert record is not None and record.prefill_tokens == 1 and record.finished == ("a",)


# ---- scheduling ------------------------------------------------------------------------------------------


def test_chunked_prefill_takes_ceil_prompt_over_budget_steps() -> None:
    for prompt in (1, 99, 100, 101, 250, 1000):
        engine = BatchingEngine(SIMPLE)
        engine.submit("long", 0.0, prompt_tokens=prompt, cached_tokens=0, output_tokens=1)
        steps = engine.run_to_completion()
        assert len(steps) == math.ceil(prompt / SIMPLE.max_batch_tokens)
        assert all(s.prefill_tokens <= SIMPLE.max_batch_tokens for s in steps)
        assert sum(s.prefill_tokens for s in steps) == prompt
        assert engine.result("long").first_token_s == steps[-1].end_s


def test_decodes_take_the_budget_first_and_prefill_chunks_the_rest() -> None:
    engine = BatchingEngine(SIMPLE)
    engine.submit("d1", 0.0, prompt_tokens=10, cached_tokens=0, output_tokens=50)
    engine.submit("d2", 0.0, prompt_tokens=10, cached_tokens=0, output_tokens=50)
    engine.step()  # both prefill together: 20 tokens
    engine.submit("big", engine.now_s, prompt_tokens=300, cached_tokens=0, output_tokens=1)
    record = engine.step()
    assert record is not None
    assert (record.decode_seqs, record.prefill_tokens) == (2, SIMPLE.max_batch_tokens - 2)


def test_admission_is_fifo_when_max_running_limits_it() -> None:
    engine = BatchingEngine(SIMPLE)  # max_running = 4
    for i in range(12):
        engine.submit(f"r{i}", 0.001 * i, prompt_tokens=30, cached_tokens=0, output_tokens=20)
    engine.run_to_completion()
    results = [engine.result(f"r{i}") for i in range(12)]
    for earlier, later in itertools.pairwise(results):
        assert earlier.admitted_s is not None and later.admitted_s is not None
        assert earlier.first_token_s is not None and later.first_token_s is not None
        assert earlier.admitted_s <= later.admitted_s
        assert earlier.first_token_s <= later.first_token_s
    # at most four run at once, so the fifth waits for the first to finish
    assert results[4].admitted_s is not None and results[0].finish_s is not None
    assert results[4].admitted_s >= results[0].finish_s


def test_kv_capacity_limits_admission() -> None:
    small = with_overrides(SIMPLE, kv_capacity_tokens=128, max_running=100)
    assert kv_tokens_needed(small, 40, 10) == 64  # 50 tokens -> four 16-token blocks
    engine = BatchingEngine(small)
    for i in range(3):
        engine.submit(f"r{i}", 0.0, prompt_tokens=40, cached_tokens=0, output_tokens=10)
    record = engine.step()
    assert record is not None and record.admitted == ("r0", "r1")
    assert engine.kv_used_tokens == 128 and engine.waiting == 1
    engine.run_to_completion()
    r2 = engine.result("r2")
    r0 = engine.result("r0")
    assert r2.admitted_s is not None and r0.finish_s is not None and r2.admitted_s >= r0.finish_s
    with pytest.raises(ValueError, match="KV tokens"):
        engine.submit("huge", 10.0, prompt_tokens=200, cached_tokens=0, output_tokens=1)


def test_submit_rejects_bad_input() -> None:
    engine = BatchingEngine(SIMPLE)
    engine.submit("a", 1.0, prompt_tokens=10, cached_tokens=0, output_tokens=1)
    with pytest.raises(ValueError, match="already submitted"):
        engine.submit("a", 2.0, prompt_tokens=10, cached_tokens=0, output_tokens=1)
    with pytest.raises(ValueError, match="must not decrease"):
        engine.submit("b", 0.5, prompt_tokens=10, cached_tokens=0, output_tokens=1)
    with pytest.raises(ValueError, match="cached_tokens"):
        engine.submit("c", 2.0, prompt_tokens=10, cached_tokens=11, output_tokens=1)


def test_an_idle_engine_starts_at_the_arrival() -> None:
    engine = BatchingEngine(SIMPLE)
    assert engine.next_event_time() is None and engine.step() is None
    engine.submit("a", 5.0, prompt_tokens=20, cached_tokens=0, output_tokens=1)
    assert engine.next_event_time() == pytest.approx(5.0 + step_time_s(SIMPLE, 20, 0))
    assert engine.run_until(5.0) == []
    steps = engine.run_until(6.0)
    assert len(steps) == 1 and steps[0].start_s == 5.0


# ---- queueing --------------------------------------------------------------------------------------------


def _steady_load(p: EngineProfile, load: float, prompt: int, n: int) -> tuple[BatchingEngine, list[int]]:
    """Prefill-only requests (one output token) at ``load`` times the profile's prefill throughput, evenly
    spaced, advanced as a simulator would (run up to each arrival, then submit it). Returns the engine and
    its ``waiting`` count sampled at every quarter of the arrivals."""
    rate = load * prefill_throughput_tokens_per_s(p) / prompt  # requests/s
    engine = BatchingEngine(p)
    waiting: list[int] = []
    for i in range(n):
        t = i / rate
        engine.run_until(t)
        engine.submit(f"r{i}", t, prompt_tokens=prompt, cached_tokens=0, output_tokens=1)
        if (i + 1) % (n // 4) == 0:
            waiting.append(engine.waiting)
    return engine, waiting


def _ttfts(engine: BatchingEngine, n: int) -> list[float]:
    out = []
    for i in range(n):
        result = engine.result(f"r{i}")
        assert result.first_token_s is not None
        out.append(result.first_token_s - result.arrival_s)
    return out


@pytest.mark.parametrize("name", ["llama3-8b-h100", "llama3-70b-h100"])
def test_a_queue_forms_when_arrivals_exceed_the_configured_throughput(name: str) -> None:
    p = profile(name)
    prompt, n = 2048, 600
    engine, waiting = _steady_load(p, 1.5, prompt, n)
    # a third of the offered work cannot be served as it arrives: the backlog grows linearly
    assert waiting == sorted(waiting) and waiting[0] > 0
    assert waiting[-1] > n // 5
    assert engine.queued_prefill_tokens > (n // 5) * prompt
    engine.run_to_completion()
    ttft = _ttfts(engine, n)
    quarter = n // 4
    early, late = sum(ttft[:quarter]) / quarter, sum(ttft[-quarter:]) / quarter
    assert late > 5 * early  # time to first token grows with the backlog
    assert ttft[-1] > ttft[n // 2] > ttft[quarter]


@pytest.mark.parametrize("name", ["llama3-8b-h100", "llama3-70b-h100"])
def test_no_queue_forms_at_half_the_configured_throughput(name: str) -> None:
    p = profile(name)
    prompt, n = 2048, 600
    engine, waiting = _steady_load(p, 0.5, prompt, n)
    assert max(waiting) <= 1  # at most the request that just arrived
    engine.run_to_completion()
    ttft = _ttfts(engine, n)
    alone = step_time_s(p, prompt, 0)
    assert max(ttft) < 3 * alone  # at most the step in flight plus its own
    quarter = n // 4
    assert sum(ttft[-quarter:]) / quarter < 1.2 * sum(ttft[:quarter]) / quarter


def test_steady_state_prefill_throughput_is_budget_over_step_time() -> None:
    assert prefill_throughput_tokens_per_s(SIMPLE) == pytest.approx(100 / (0.010 + 0.100))
    assert prefill_throughput_tokens_per_s(SIMPLE, decode_seqs=4) == pytest.approx(
        96 / (0.010 + 0.096 + 0.008)
    )
    p8 = profile("llama3-8b-h100")
    assert 25_000 < prefill_throughput_tokens_per_s(p8) < 40_000  # the ≈33k tokens/s of the derivation


# ---- determinism -----------------------------------------------------------------------------------------


def _mixed_workload(engine: BatchingEngine) -> list[tuple[float, float, float, int, int, int]]:
    for i in range(200):
        engine.submit(f"r{i}", 0.003 * i, prompt_tokens=50 + (i * 37) % 900, cached_tokens=(i * 11) % 40,
                      output_tokens=1 + (i * 13) % 60)  # fmt: skip
    return [
        (s.start_s, s.end_s, s.duration_s, s.prefill_tokens, s.decode_seqs, s.cached_tokens_read)
        for s in engine.run_to_completion()
    ]


def test_two_engines_give_the_same_step_times_for_the_same_batch() -> None:
    p = profile("llama3-8b-h100")
    a, b = BatchingEngine(p), BatchingEngine(profile("llama3-8b-h100"))
    steps_a, steps_b = _mixed_workload(a), _mixed_workload(b)
    assert steps_a == steps_b  # bit for bit
    for _, _, duration, prefill, decodes, cached in steps_a:
        assert duration == step_time_s(p, prefill, decodes, cached)
    assert [a.result(f"r{i}") for i in range(200)] == [b.result(f"r{i}") for i in range(200)]


def test_run_until_in_slices_matches_running_to_completion() -> None:
    whole = BatchingEngine(SIMPLE)
    sliced = BatchingEngine(SIMPLE)
    arrivals = [(f"r{i}", 0.02 * i, 20 + (i * 7) % 150, 1 + i % 9) for i in range(60)]
    for rid, t, prompt, out in arrivals:
        whole.submit(rid, t, prompt_tokens=prompt, cached_tokens=0, output_tokens=out)
    whole.run_to_completion()
    for rid, t, prompt, out in arrivals:
        sliced.run_until(t)
        sliced.submit(rid, t, prompt_tokens=prompt, cached_tokens=0, output_tokens=out)
    sliced.run_to_completion()
    assert [whole.result(r[0]) for r in arrivals] == [sliced.result(r[0]) for r in arrivals]


# ---- profiles --------------------------------------------------------------------------------------------


def test_profiles_load_by_name() -> None:
    assert {"llama3-8b-h100", "llama3-70b-h100"} <= set(profile_names())
    assert profile("llama3-8b-h100") is PROFILES["llama3-8b-h100"]
    p8, p70 = profile("llama3-8b-h100"), profile("llama3-70b-h100")
    assert p70.prefill_s_per_token > p8.prefill_s_per_token and p70.step_fixed_s > p8.step_fixed_s


def test_an_unknown_profile_raises_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown engine profile 'gpt5-b200'; known: .*llama3-8b-h100"):
        profile("gpt5-b200")


def test_overrides_apply_and_are_checked() -> None:
    base = profile("llama3-8b-h100")
    changed = with_overrides(base, **parse_overrides(" step_fixed_s=0.004 , max_running=128,"))
    assert (
        changed.step_fixed_s == 0.004 and changed.max_running == 128 and isinstance(changed.max_running, int)
    )
    assert changed.prefill_s_per_token == base.prefill_s_per_token
    assert base.step_fixed_s == 7.0e-3  # the named profile is untouched
    assert parse_overrides("") == {}
    with pytest.raises(ValueError, match="unknown EngineProfile field 'warp'"):
        parse_overrides("warp=9")
    with pytest.raises(ValueError, match="not FIELD=VALUE"):
        parse_overrides("step_fixed_s")
    with pytest.raises(ValueError, match="not a number"):
        parse_overrides("step_fixed_s=fast")
    with pytest.raises(ValueError, match="integer"):
        with_overrides(base, max_running=1.5)
    with pytest.raises(ValueError, match="unknown EngineProfile field"):
        with_overrides(base, warp=9)
    with pytest.raises(ValueError, match=">= 1"):
        with_overrides(base, max_batch_tokens=0)
    with pytest.raises(ValueError, match=">= 0"):
        with_overrides(base, decode_s_per_seq=-1)


def test_an_aborted_request_leaves_the_queue_and_the_batch_and_frees_its_kv() -> None:
    p = with_overrides(profile("llama3-8b-h100"), max_batch_tokens=100, max_running=1)
    engine = BatchingEngine(p)
    engine.submit("a", 0.0, 300, 0, 50)
    engine.submit("b", 0.0, 300, 0, 50)
    engine.submit("c", 0.0, 300, 0, 1)
    engine.step()  # a admitted, 100 of its 300 prefill tokens
    assert (engine.running, engine.waiting, engine.queued_prefill_tokens) == (1, 2, 800)
    assert engine.abort("b")  # waiting
    assert (engine.waiting, engine.queued_prefill_tokens) == (1, 500)
    kv = engine.kv_used_tokens
    assert engine.abort("a") and engine.kv_used_tokens == 0 < kv  # running
    assert not engine.abort("a") and not engine.abort("nobody")
    engine.run_to_completion()
    c = engine.result("c")
    assert c.first_token_s is not None and c.finish_s is not None  # c ran at once, alone
    assert engine.idle()
