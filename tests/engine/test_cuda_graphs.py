"""Decode steps padded to a CUDA graph bucket, run eagerly on CPU: the padding rows change no real row's
output and write no real KV block (capture and replay: tests/gpu/test_cuda_graphs_gpu.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.cuda_graphs import DecodeGraphs, decode_buckets
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_runner import ModelRunner
from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams

BLOCKS = 64


def test_buckets_are_powers_of_two_up_to_the_largest_batch() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(8) == [1, 2, 4, 8]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]


def engine(model_dir: Path) -> LLMEngine:
    config = EngineConfig(str(model_dir), block_size=4, num_kv_blocks=BLOCKS, device="cpu", max_num_seqs=8)
    return LLMEngine(config)


def padded(engine: LLMEngine) -> DecodeGraphs:
    """The CUDA path's padding, run eagerly: what a graph replays, on CPU."""
    runner, cache = engine.runner, engine.kv_cache
    assert isinstance(runner, ModelRunner) and cache is not None
    assert runner.decode_graphs is None  # no graphs off CUDA
    graphs = DecodeGraphs(runner.model, cache, BLOCKS, 8, 16, engine.device, capture=False)
    runner.decode_graphs = graphs
    return graphs


def test_padded_decode_steps_equal_unpadded_ones_and_write_only_the_scratch_block(
    tiny_model_dir: Path,
) -> None:
    plain, pad = engine(tiny_model_dir), engine(tiny_model_dir)
    graphs = padded(pad)
    vocab = plain.model_config.vocab_size
    # Five sequences that finish one after another: decode steps of 5, 4, 3, 2 and 1 rows (buckets 8, 4, 4,
    # 2, 1: a smaller step after a larger one in the same bucket turns the rows it left back to padding).
    prompts = [[(5 * i + 3 * j + 1) % vocab for j in range(3 + i)] for i in range(5)]
    params = [SamplingParams(max_tokens=2 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(5)]
    for e in (plain, pad):
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            e.add_request(f"r{i}", prompt, p)

    runner = pad.runner
    assert isinstance(runner, ModelRunner)
    run = runner.run
    scratch = slice(BLOCKS * 4, (BLOCKS + 1) * 4)

    def checked(batch: list[ScheduledSeq]) -> torch.Tensor:
        """A decode step writes its rows' slots and the scratch block, nothing else."""
        assert pad.kv_cache is not None
        before = [k.clone() for k in pad.kv_cache.k]
        logits = run(batch)
        if all(item.num_new == 1 for item in batch):
            own = {
                item.seq.block_table[item.seq.num_computed // 4] * 4 + item.seq.num_computed % 4
                for item in batch
            }
            for k_before, k_after in zip(before, pad.kv_cache.k, strict=True):
                changed = set((k_before != k_after).any(dim=(1, 2)).nonzero().flatten().tolist())
                assert changed - set(range(scratch.start, scratch.stop)) <= own
        return logits

    runner.run = checked  # type: ignore[method-assign]
    steps = 0
    while plain.has_work():
        want, got = plain.step(), pad.step()
        assert [(o.request_id, o.token_ids) for o in got] == [(o.request_id, o.token_ids) for o in want]
        steps += 1
    assert not pad.has_work() and graphs.replays >= 5
    assert plain.kv_cache is not None and pad.kv_cache is not None
    for ours, theirs in zip(
        pad.kv_cache.k + pad.kv_cache.v, plain.kv_cache.k + plain.kv_cache.v, strict=True
    ):
        torch.testing.assert_close(ours[: scratch.start], theirs[: scratch.start], atol=1e-5, rtol=1e-5)
        assert ours[scratch].abs().sum() > 0 and theirs[scratch].abs().sum() == 0  # padding wrote there only


def test_the_engine_cli_turns_graphs_off_with_no_cuda_graphs() -> None:
    import argparse

    from engine.cli import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    base = ["--model", "m", "--port", "0"]
    assert parser.parse_args(base).cuda_graphs is True
    assert parser.parse_args([*base, "--no-cuda-graphs"]).cuda_graphs is False
