"""Tensor and pipeline parallelism end to end, on CPU worker processes (gloo): tp=2, pp=2 and tp=2 x pp=2 give
exactly the greedy tokens of one process, and a rank that dies turns the engine red and fails its requests."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from engine.async_engine import EngineDead
from engine.cli import main as engine_main
from engine.engine_types import TokenLogprob
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model.errors import ModelLoadError
from engine.model_runner import ModelRunner
from engine.parallel.executor import ParallelExecutor, RankFailed
from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams, Sequence
from engine.server import ENGINE_SERVER, EngineServer, ServerConfig, build_app
from tests.serving import serve

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# tp4: the tiny model's 2 KV heads are each replicated on two ranks
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "tp2xpp2": (2, 2), "tp4": (4, 1)}


def config(model_dir: Path, tp: int = 1, pp: int = 1, **overrides: Any) -> EngineConfig:
    # A 16-token budget chunks the longer prompts and mixes prefill chunks with decodes in one step.
    options: dict[str, Any] = {
        "block_size": 4,
        "num_kv_blocks": 128,
        "device": "cpu",
        "max_num_batched_tokens": 16,
        **overrides,
    }
    return EngineConfig(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)


def prompts(vocab: int) -> list[list[int]]:
    """Different lengths; the last two share a 3-block prefix, so one reads the other's blocks."""
    shared = [(11 * j + 5) % vocab for j in range(12)]
    lengths = (5, 17, 30, 9)
    own = [[(7 * i + 13 * j + 3) % vocab for j in range(n)] for i, n in enumerate(lengths)]
    return [*own, [*shared, 1, 2, 3], [*shared, 4, 5]]


def run(engine: LLMEngine, batch: list[list[int]], tag: str) -> tuple[list[list[int]], list[int]]:
    """All prompts at once through the engine's steps: the tokens of each and its cached prompt tokens."""
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for request_id, prompt in zip(ids, batch, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    cached: dict[str, int] = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            if out.finished:
                cached[out.request_id] = out.cached_tokens
    return [tokens[i] for i in ids], [cached[i] for i in ids]


Run = tuple[list[list[int]], list[int]]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[Run, Run]:
    """One process, the same schedule: two rounds of the prompts (the second from the prefix cache)."""
    engine = LLMEngine(config(tiny_model_dir))
    assert isinstance(engine.runner, ModelRunner)  # tp = pp = 1 spawns nothing
    batch = prompts(engine.model_config.vocab_size)
    return run(engine, batch, "first"), run(engine, batch, "again")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def parallel_engine(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[LLMEngine]:
    tp, pp = LAYOUTS[request.param]
    engine = LLMEngine(config(tiny_model_dir, tp, pp))
    assert isinstance(engine.runner, ParallelExecutor)
    engine.runner.min_micro_batch_tokens = 1  # the tiny steps here are cut into micro-batches all the same
    yield engine
    engine.close()


def test_parallel_greedy_tokens_are_exactly_one_process_tokens(
    parallel_engine: LLMEngine, reference: tuple[Run, Run]
) -> None:
    batch = prompts(parallel_engine.model_config.vocab_size)
    first, again = run(parallel_engine, batch, "first"), run(parallel_engine, batch, "again")
    assert first == reference[0]  # tokens, and the cached prompt tokens of each
    assert again == reference[1]
    assert sum(again[1]) > sum(first[1]) > 0  # the second round read its prompts from the prefix cache
    assert again[0] == first[0]
    runner = parallel_engine.runner
    assert isinstance(runner, ParallelExecutor)
    if runner.parallel.pipeline_parallel_size > 1:
        assert runner.micro_batches > runner.steps  # steps with several sequences were cut in micro-batches
    else:
        assert runner.micro_batches == runner.steps


# Seeded draws under every sampling option the last stage must apply as the driver's sampler did.
SAMPLED = [
    SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=2),
    SamplingParams(max_tokens=8, top_k=20, seed=3, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(max_tokens=8, seed=11, min_tokens=5, logit_bias=((5, 3.0),), presence_penalty=0.4),
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, min_p=0.05),
]
Sampled = list[tuple[list[int], list[TokenLogprob]]]


def run_sampled(engine: LLMEngine, tag: str) -> Sampled:
    batch = prompts(engine.model_config.vocab_size)[: len(SAMPLED)]
    ids = [f"{tag}-{i}" for i in range(len(batch))]
    for request_id, prompt, params in zip(ids, batch, SAMPLED, strict=True):
        engine.add_request(request_id, prompt, params)
    out: dict[str, tuple[list[int], list[TokenLogprob]]] = {i: ([], []) for i in ids}
    while engine.has_work():
        for step in engine.step():
            out[step.request_id][0].extend(step.token_ids)
            out[step.request_id][1].extend(step.logprobs)
    return [out[i] for i in ids]


@pytest.fixture(scope="module")
def sampled_reference(tiny_model_dir: Path) -> Sampled:
    return run_sampled(LLMEngine(config(tiny_model_dir)), "sampled")


def test_the_last_stage_samples_seeded_tokens_exactly_as_one_process(
    parallel_engine: LLMEngine, sampled_reference: Sampled, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_logits_here(*args: object) -> None:
        raise AssertionError("the driver sampled: logits came back from the ranks")

    monkeypatch.setattr(parallel_engine.sampler, "sample", no_logits_here)
    got = run_sampled(parallel_engine, "sampled")
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in sampled_reference]
    for (_, logprobs), (_, expected) in zip(got, sampled_reference, strict=True):
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs] == [
            (lp.token_id, [t for t, _ in lp.top]) for lp in expected
        ]
        flat = [v for lp in logprobs for v in (lp.logprob, *(v for _, v in lp.top))]
        assert flat == pytest.approx(
            [v for lp in expected for v in (lp.logprob, *(v for _, v in lp.top))], abs=1e-4
        )
    assert [bool(lps) for _, lps in got] == [p.logprobs is not None for p in SAMPLED]


def test_an_unsplittable_layout_is_refused_with_a_clear_message(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["engine", "--model", str(tiny_model_dir), "--port", "0", "--device", "cpu"]
    assert engine_main([*argv, "--tp", "3"]) == 2  # 4 attention heads
    assert "num_attention_heads=4 is not divisible by --tp 3" in capsys.readouterr().err
    assert engine_main([*argv, "--pp", "3"]) == 2  # 2 layers
    assert "--pp 3 exceeds the model's 2 layers" in capsys.readouterr().err


def test_a_bad_checkpoint_fails_in_the_workers_as_a_model_load_error(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny_model_dir.iterdir():
        if item.name != "model.safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        LLMEngine(config(broken, 2, 1))


def test_a_step_that_fails_on_the_ranks_fails_the_engine_with_their_error(tiny_model_dir: Path) -> None:
    engine = LLMEngine(config(tiny_model_dir, 2, 1))
    runner = engine.runner
    assert isinstance(runner, ParallelExecutor)
    try:
        bad = Sequence("bad", [1, 2, 3], GREEDY, 0, block_table=[10_000])  # a block no cache has
        failed = r"rank [01] \(pipeline stage 0, tensor-parallel rank [01]\) failed: IndexError"
        with pytest.raises(RankFailed, match=failed):
            runner.execute([ScheduledSeq(bad, 3, True)])
        assert engine.failure is not None
        with pytest.raises(RankFailed):  # every later step too, without reaching the ranks
            runner.execute([ScheduledSeq(bad, 3, True)])
        for process in runner.processes:
            process.join(5.0)
        assert not any(p.is_alive() for p in runner.processes)
    finally:
        engine.close()


# -- a rank that dies ----------------------------------------------------------------------------------------


class Served:
    def __init__(self, server: EngineServer, url: str, session: aiohttp.ClientSession) -> None:
        self.server, self.url, self.session = server, url, session

    async def health(self) -> tuple[int, Any]:
        async with self.session.get(self.url + "/health") as r:
            return r.status, await r.json()

    async def complete(self) -> tuple[int, Any]:
        body = {"model": self.server.model, "prompt": "hello", "max_tokens": 3}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    def kill(self, rank: int) -> None:
        runner = self.server.llm.runner
        assert isinstance(runner, ParallelExecutor)
        pid = runner.processes[rank].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    async def until_red(self, within_s: float) -> Any:
        """The body of the first non-200 /health, polled until ``within_s`` have passed."""
        start = time.monotonic()
        while time.monotonic() - start < within_s:
            status, body = await self.health()
            if status != 200:
                assert status == 503
                return body
            await asyncio.sleep(0.05)
        raise AssertionError(f"/health still 200 {within_s} s after a rank was killed")


@pytest.fixture
async def served(tiny_model_dir: Path) -> AsyncIterator[Served]:
    engine = LLMEngine(config(tiny_model_dir, 1, 2, num_kv_blocks=1024))
    app = build_app(engine, ServerConfig(engine_id="test/parallel"))
    runner = web.AppRunner(app, handler_cancellation=True)
    url = await serve(runner)
    try:
        async with aiohttp.ClientSession() as session:
            yield Served(app[ENGINE_SERVER], url, session)
    finally:
        await runner.cleanup()
        engine.close()


def assert_failed_cleanly(status: int, body: Any) -> None:
    assert status == 503
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "engine_failed"
    assert "rank" in body["error"]["message"]


async def test_an_idle_engine_turns_red_when_a_rank_dies(served: Served) -> None:
    status, body = await served.complete()
    assert status == 200, body
    assert (await served.health())[0] == 200
    served.kill(0)
    health = await served.until_red(within_s=5.0)
    assert "rank 0 (pipeline stage 0, tensor-parallel rank 0) died" in health["error"]
    assert_failed_cleanly(*await asyncio.wait_for(served.complete(), 10))
    runner = served.server.llm.runner
    assert isinstance(runner, ParallelExecutor)
    # The survivor is stopped (the watchdog terminates it right after raising the alarm), not left waiting.
    for process in runner.processes:
        await asyncio.to_thread(process.join, 5.0)
    assert not any(p.is_alive() for p in runner.processes)


async def test_a_rank_dying_mid_generation_fails_the_request_in_flight(served: Served) -> None:
    engine = served.server.engine
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)  # minutes if nothing failed
    outputs = engine.generate("in-flight", [5, 6, 7, 8, 9], long)
    first = await anext(outputs)
    assert first.completion_tokens >= 1 and not first.finished
    served.kill(1)  # the last stage, mid-step or between steps
    with pytest.raises(EngineDead, match="rank 1"):
        async with asyncio.timeout(10):
            async for _ in outputs:
                pass
    await served.until_red(within_s=1.0)
    assert_failed_cleanly(*await asyncio.wait_for(served.complete(), 10))
    assert isinstance(served.server.llm.failure, RankFailed)
