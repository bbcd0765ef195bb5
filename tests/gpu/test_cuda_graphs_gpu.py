"""Decode steps replayed from CUDA graphs against the same steps run eagerly (skipped without CUDA): the same
greedy tokens, logits within rounding (the graph fixes the decode kernel's split count), the same K/V in every
real block."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BLOCKS, BLOCK = 256, 16


def make(model_dir: Path, graphs: bool) -> tuple[LLMEngine, ModelRunner, list[torch.Tensor]]:
    config = EngineConfig(
        str(model_dir),
        block_size=BLOCK,
        num_kv_blocks=BLOCKS,
        device="cuda",
        max_num_seqs=8,
        cuda_graphs=graphs,
    )
    engine = LLMEngine(config)
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    logits: list[torch.Tensor] = []
    run = runner.run

    def recording(batch: list[ScheduledSeq]) -> torch.Tensor:
        out = run(batch)
        logits.append(out.clone())
        return out

    runner.run = recording  # type: ignore[method-assign]
    return engine, runner, logits


def test_graph_replay_gives_the_eager_tokens_logits_and_kv(tiny_model_dir: Path) -> None:
    eager, _, eager_logits = make(tiny_model_dir, False)
    graphed, runner, graph_logits = make(tiny_model_dir, True)
    graphs = runner.decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    vocab = eager.model_config.vocab_size
    prompts = [[(5 * i + 3 * j + 1) % vocab for j in range(3 + 7 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=3 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(6)]
    assert graphed.generate(prompts, params) == eager.generate(prompts, params)
    assert graphs.replays > 0
    assert len(graph_logits) == len(eager_logits)
    for ours, theirs in zip(graph_logits, eager_logits, strict=True):
        torch.testing.assert_close(ours, theirs, atol=2e-3, rtol=2e-3)
    assert graphed.kv_cache is not None and eager.kv_cache is not None
    real = BLOCKS * BLOCK
    for ours, theirs in zip(
        graphed.kv_cache.k + graphed.kv_cache.v, eager.kv_cache.k + eager.kv_cache.v, strict=True
    ):
        torch.testing.assert_close(ours[:real], theirs[:real], atol=2e-3, rtol=2e-3)
        assert theirs[real:].abs().sum() == 0  # only padding writes the scratch block
