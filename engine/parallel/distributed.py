"""Rank layout of a tp x pp engine and its process groups on torch.distributed (gloo on CPU, NCCL on GPU).

Ranks are numbered stage-major: ``rank = stage * tp + tp_rank``. The ``tp`` ranks of a stage form its tensor
parallel group (all-reduce, all-gather); rank ``r`` of stage ``s`` sends its hidden states to rank ``r`` of
stage ``s + 1`` (after the all-reduce every rank of a stage holds the same hidden state).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.model.config import ModelConfig


class ParallelConfigError(ValueError):
    """A tp x pp layout this model cannot be split into (the message says which dimension does not divide)."""


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ParallelConfigError(
                f"--tp and --pp must be >= 1 (got {self.tensor_parallel_size} and "
                f"{self.pipeline_parallel_size})"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def place(self, rank: int) -> tuple[int, int]:
        """``(stage, tp_rank)`` of a global rank."""
        return divmod(rank, self.tensor_parallel_size)

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tensor_parallel_size + tp_rank


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its stage's tensor-parallel group (``group`` is None in a single process)."""

    size: int
    rank: int
    group: Any = None  # a torch.distributed ProcessGroup

    @property
    def enabled(self) -> bool:
        return self.size > 1


@dataclass(frozen=True)
class RankPlacement:
    """What one rank builds and loads: its tensor-parallel shard and its stage's contiguous layers."""

    tp: TensorParallel
    pp_size: int
    pp_rank: int
    layers: range

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The contiguous layers of ``stage``; the first ``num_layers % pp`` stages take one extra layer."""
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def check_parallel(config: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ParallelConfigError when the model cannot be split ``tp x pp`` ways."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp:
        raise ParallelConfigError(f"num_attention_heads={heads} is not divisible by --tp {tp}")
    if kv_heads % tp and tp % kv_heads:
        raise ParallelConfigError(
            f"num_key_value_heads={kv_heads} and --tp {tp}: one must divide the other (KV heads are split "
            "across ranks, or replicated when there are fewer of them than ranks)"
        )
    if config.intermediate_size % tp:
        raise ParallelConfigError(
            f"intermediate_size={config.intermediate_size} is not divisible by --tp {tp}"
        )
    if pp > config.num_hidden_layers:
        raise ParallelConfigError(
            f"--pp {pp} exceeds the model's {config.num_hidden_layers} layers (each stage needs one)"
        )


def kv_bytes_per_block(
    config: ModelConfig, parallel: ParallelConfig, block_size: int, element_size: int
) -> int:
    """KV cache bytes one block takes on the busiest rank (the stage with the most layers)."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    layers = max(len(stage_layers(config.num_hidden_layers, pp, s)) for s in range(pp))
    kv_heads = max(1, config.num_key_value_heads // tp)
    return 2 * layers * block_size * kv_heads * config.head_dim * element_size


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def join_world(
    parallel: ParallelConfig, rank: int, init_method: str, device: torch.device, timeout_s: float
) -> Any:
    """Join the process group (every rank calls this with the same arguments but ``rank``) and create the
    tensor-parallel group of every stage; returns this rank's (None when tp is 1). ``timeout_s`` bounds
    each collective, so that a rank whose peer died fails instead of waiting forever."""
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=parallel.world_size,
        timeout=timeout,
    )
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    stage = parallel.place(rank)[0]
    group = None
    for s in range(pp):  # every rank creates every group, in the same order (torch.distributed requires it)
        ranks = [parallel.rank(s, r) for r in range(tp)]
        created = dist.new_group(ranks, timeout=timeout) if tp > 1 else None
        if s == stage:
            group = created
    return group


def placement_for(
    config: ModelConfig, parallel: ParallelConfig, rank: int, group: Any = None
) -> RankPlacement:
    """The placement of ``rank``; ``group`` is its tensor-parallel group (None: load only, no collectives)."""
    stage, tp_rank = parallel.place(rank)
    return RankPlacement(
        TensorParallel(parallel.tensor_parallel_size, tp_rank, group),
        parallel.pipeline_parallel_size,
        stage,
        stage_layers(config.num_hidden_layers, parallel.pipeline_parallel_size, stage),
    )
