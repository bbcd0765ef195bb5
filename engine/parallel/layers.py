"""Tensor-parallel layers (Megatron's split): each rank holds a slice of a weight and the collectives that
make the slices add up to the whole layer.

Column-parallel (q/k/v, gate/up) holds a block of output rows and leaves its output split; row-parallel
(o, down) holds the matching block of input columns and all-reduces its partial products. The vocabulary
is split in rows too: the embedding all-reduces (each token is found on one rank, zeros elsewhere), the head
all-gathers its logits. Each layer says in ``shards`` which slice of the full checkpoint tensor it holds, so
the loader reads only that slice. With ``tp.size == 1`` the factories return plain ``nn.Linear`` and
``nn.Embedding``: a single process is exactly the model it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.parallel.distributed import TensorParallel


@dataclass(frozen=True)
class Shard:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``start .. stop`` of the full tensor. ``stop`` may pass the
    full size (the vocabulary is padded to a multiple of tp): those rows are zeros."""

    dim: int
    start: int
    stop: int


class ColumnParallelLinear(nn.Module):
    """``y[:, rows] = x @ W[rows].T + b[rows]``: this rank's block of output features; no communication."""

    def __init__(self, in_features: int, rows: range, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(len(rows), in_features))
        self.bias = nn.Parameter(torch.empty(len(rows))) if bias else None
        self.shards = {"weight": Shard(0, rows.start, rows.stop), "bias": Shard(0, rows.start, rows.stop)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x[:, cols] @ W[:, cols].T``, then the bias once: input split like the
    column-parallel layer before it left its output, output whole on every rank."""

    def __init__(self, cols: range, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, len(cols)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None  # whole on every rank
        self.shards = {"weight": Shard(1, cols.start, cols.stop)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.tp.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``start .. start + per_rank`` of the embedding; a token outside them reads zeros here and its
    vector from the one rank that holds it (all-reduce adds exact zeros, so the sum is exact)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(len(self.rows), hidden))
        self.shards = {"weight": Shard(0, self.rows.start, self.rows.stop)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        here = (input_ids >= self.rows.start) & (input_ids < self.rows.stop)
        local = torch.where(here, input_ids - self.rows.start, 0)
        x = F.embedding(local, self.weight).masked_fill(~here.unsqueeze(-1), 0.0)
        dist.all_reduce(x, group=self.tp.group)
        return x


class ParallelLMHead(nn.Module):
    """The head's rows for the same vocabulary slice as the embedding (so tied weights tie shard to shard);
    each rank computes its logits and all-gather puts the whole vocabulary on every rank."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(len(rows), hidden))
        self.shards = {"weight": Shard(0, rows.start, rows.stop)}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.tp.size)]
        dist.all_gather(parts, local, group=self.tp.group)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


# -- factories: plain modules in one process, parallel ones across ranks -------------------------------------


def column_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Module:
    if tp is None or not tp.enabled:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, even_split(out_features, tp), bias)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallel | None) -> nn.Module:
    if tp is None or not tp.enabled:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(even_split(in_features, tp), out_features, bias, tp)


def embedding(vocab_size: int, hidden: int, tp: TensorParallel | None) -> nn.Module:
    if tp is None or not tp.enabled:
        if torch.get_default_device().type == "meta":
            # A meta tensor holds no values, so skip the init: normal_ on meta imports torch._dynamo
            # (2 s of CPU in every fresh process, every worker rank included).
            return nn.Embedding(vocab_size, hidden, _weight=torch.empty(vocab_size, hidden))
        return nn.Embedding(vocab_size, hidden)
    return VocabParallelEmbedding(vocab_size, hidden, tp)


def lm_head(hidden: int, vocab_size: int, tp: TensorParallel | None) -> nn.Module:
    if tp is None or not tp.enabled:
        return nn.Linear(hidden, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden, tp)


def attention_projections(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TensorParallel | None
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """q, k and v projections. Across ranks each holds ``num_heads / tp`` query heads and the KV heads they
    read: ``num_kv_heads / tp`` of them, or one replicated head when there are fewer KV heads than ranks."""
    if tp is None or not tp.enabled:
        kv = num_kv_heads * head_dim
        return (
            nn.Linear(hidden, num_heads * head_dim, bias=bias),
            nn.Linear(hidden, kv, bias=bias),
            nn.Linear(hidden, kv, bias=bias),
        )
    kv_rows = kv_head_rows(num_kv_heads, head_dim, tp)
    return (
        ColumnParallelLinear(hidden, even_split(num_heads * head_dim, tp), bias),
        ColumnParallelLinear(hidden, kv_rows, bias),
        ColumnParallelLinear(hidden, kv_rows, bias),
    )


def even_split(size: int, tp: TensorParallel) -> range:
    if size % tp.size:
        raise ValueError(f"a dimension of {size} cannot be split evenly over {tp.size} tensor-parallel ranks")
    per = size // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def kv_head_rows(num_kv_heads: int, head_dim: int, tp: TensorParallel) -> range:
    """Rows of k_proj/v_proj this rank holds. With fewer KV heads than ranks, ranks ``i * tp / kv ..``
    share KV head ``i``: exactly the head their query heads read under grouped-query attention."""
    if num_kv_heads % tp.size == 0:
        return even_split(num_kv_heads * head_dim, tp)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split or replicated over {tp.size} ranks")
    head = tp.rank // (tp.size // num_kv_heads)
    return range(head * head_dim, (head + 1) * head_dim)


def vocab_rows(vocab_size: int, tp: TensorParallel) -> range:
    per = -(-vocab_size // tp.size)  # padded up: the last rank's tail rows are zeros
    return range(tp.rank * per, (tp.rank + 1) * per)


def shard_map(model: nn.Module) -> dict[str, Shard]:
    """Full parameter name -> the slice of the checkpoint tensor it holds, for every sharded parameter."""
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        shards: dict[str, Shard] = getattr(module, "shards", {})
        for local, shard in shards.items():
            if getattr(module, local, None) is not None:
                out[f"{prefix}.{local}" if prefix else local] = shard
    return out


def read_shard(handle: Any, name: str, shard: Shard) -> torch.Tensor:
    """Read only ``shard`` of tensor ``name`` from a safetensors handle, zero-padded past the end."""
    piece = handle.get_slice(name)
    full = piece.get_shape()[shard.dim]
    stop = min(shard.stop, full)
    part = piece[shard.start : stop] if shard.dim == 0 else piece[:, shard.start : stop]
    if stop == shard.stop:
        return part  # type: ignore[no-any-return]
    pad = list(part.shape)
    pad[shard.dim] = shard.stop - stop
    return torch.cat([part, part.new_zeros(pad)], dim=shard.dim)
