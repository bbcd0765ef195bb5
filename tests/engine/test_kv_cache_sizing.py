"""KV cache sizing: the arithmetic from free device memory, the order of the options, and their parsing."""

from __future__ import annotations

import argparse

import pytest

from engine.cli import add_engine_arguments
from engine.kv_cache_sizing import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    FIXED_RESERVE_BYTES,
    GIB,
    KvCacheSizingError,
    activation_reserve_bytes,
    kv_blocks_for_memory,
    kv_cache_blocks,
)
from engine.model.config import ModelConfig

MIB = 2**20


def test_the_cache_gets_what_utilization_leaves_after_the_model() -> None:
    # An 80 GiB GPU with 60 GiB free after loading: 72 GiB may be used, 20 are, 2 are kept for a step.
    blocks = kv_blocks_for_memory(
        free_bytes=60 * GIB,
        total_bytes=80 * GIB,
        bytes_per_block=2 * MIB,
        utilization=0.9,
        reserve_bytes=2 * GIB,
    )
    assert blocks == (72 - 20 - 2) * GIB // (2 * MIB) == 25600
    # What other processes hold counts as used too; a remainder smaller than a block is left over.
    assert (
        kv_blocks_for_memory(
            free_bytes=10 * MIB + 5, total_bytes=10 * MIB + 5, bytes_per_block=MIB, utilization=1.0
        )
        == 10
    )


def test_no_room_is_zero_blocks_never_negative() -> None:
    assert (
        kv_blocks_for_memory(free_bytes=GIB, total_bytes=80 * GIB, bytes_per_block=MIB, utilization=0.9) == 0
    )
    assert (
        kv_blocks_for_memory(
            free_bytes=80 * GIB,
            total_bytes=80 * GIB,
            bytes_per_block=MIB,
            utilization=0.5,
            reserve_bytes=41 * GIB,
        )
        == 0
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"utilization": 0.0},
        {"utilization": 1.5},
        {"utilization": float("nan")},
        {"bytes_per_block": 0},
        {"free_bytes": 2 * GIB},
        {"reserve_bytes": -1},
    ],
)
def test_impossible_inputs_are_refused(bad: dict[str, float]) -> None:
    args: dict[str, float] = {
        "free_bytes": GIB,
        "total_bytes": GIB,
        "bytes_per_block": MIB,
        "utilization": 0.9,
    }
    with pytest.raises(ValueError):
        kv_blocks_for_memory(**{**args, **bad})  # type: ignore[arg-type]


def test_explicit_sizes_win_and_cpu_keeps_its_default() -> None:
    def never() -> tuple[int, int]:
        raise AssertionError("an explicit size must not profile the device")

    per_block = MIB
    assert kv_cache_blocks(bytes_per_block=per_block, on_cuda=True, num_kv_blocks=7, memory_info=never) == 7
    assert (
        kv_cache_blocks(bytes_per_block=per_block, on_cuda=True, kv_memory_gib=0.25, memory_info=never) == 256
    )
    # CPU: the size it always had (0.5 GiB), whatever the utilization says.
    assert kv_cache_blocks(bytes_per_block=per_block, on_cuda=False, gpu_memory_utilization=0.1) == 512
    assert kv_cache_blocks(bytes_per_block=GIB, on_cuda=False) == 1  # never less than one block


def test_cuda_profiles_free_memory() -> None:
    def info() -> tuple[int, int]:
        return 30 * GIB, 40 * GIB

    blocks = kv_cache_blocks(bytes_per_block=MIB, on_cuda=True, memory_info=info, reserve_bytes=GIB)
    assert blocks == (36 - 10 - 1) * 1024
    with pytest.raises(KvCacheSizingError, match="--gpu-memory-utilization"):
        kv_cache_blocks(
            bytes_per_block=MIB,
            on_cuda=True,
            memory_info=info,
            gpu_memory_utilization=0.25,
            reserve_bytes=GIB,
        )


def test_the_activation_estimate_grows_with_the_step() -> None:
    mc = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
    )
    small = activation_reserve_bytes(mc, max_num_batched_tokens=2048, max_num_seqs=64, element_size=2)
    big = activation_reserve_bytes(mc, max_num_batched_tokens=8192, max_num_seqs=64, element_size=2)
    assert FIXED_RESERVE_BYTES < small < big < 4 * GIB  # an 8B model: about 1 GiB, not tens
    split = activation_reserve_bytes(
        mc, max_num_batched_tokens=2048, max_num_seqs=64, element_size=2, tensor_parallel_size=2
    )
    assert split < small


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(["--model", "m", "--port", "0", *argv])


def test_the_options_parse_with_vllms_name_and_default() -> None:
    args = engine_args()
    assert args.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION == 0.9
    assert args.kv_memory_gib is None and args.kv_blocks is None
    args = engine_args("--gpu-memory-utilization", "0.75", "--kv-memory-gib", "2")
    assert (args.gpu_memory_utilization, args.kv_memory_gib) == (0.75, 2.0)
    assert engine_args("--gpu-memory-utilization", "1").gpu_memory_utilization == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ("--gpu-memory-utilization", "0"),
        ("--gpu-memory-utilization", "1.2"),
        ("--gpu-memory-utilization", "nan"),
        ("--gpu-memory-utilization", "most"),
        ("--kv-memory-gib", "-1"),
        ("--kv-memory-gib", "0"),
        ("--kv-memory-gib", "inf"),
    ],
)
def test_bad_values_are_refused(argv: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        engine_args(*argv)
    assert argv[0] in capsys.readouterr().err
