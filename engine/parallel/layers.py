"""Tensor-parallel layers (Megatron's split): each rank holds a slice of a weight and the collectives that
make the slices add up to the whole layer.

Column-parallel (q/k/v, gate/up) holds a block of output rows and leaves its output split; row-parallel
(o, down) holds the matching block of input columns and all-reduces its partial products. The vocabulary
is split in rows too: the embedding all-reduces (each token is found on one rank, zeros elsewhere), the head
all-gathers its logits. Each layer says in ``shards`` which slice of the full checkpoint tensor it holds, so
the loader reads only that slice. With ``tp.size == 1`` the factories return plain ``nn.Linear`` and
``nn.Embedding``: a single process is exactly the model it was.

q/k/v and gate/up run as one GEMM each (``MergedColumnLinear``) while the checkpoint keeps Hugging Face's
separate tensors: each merged layer lists its parts, and ``checkpoint_pieces`` maps every checkpoint tensor
(or this rank's slice of it) to the rows of the merged parameter it fills, as vLLM's stacked-params mapping.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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


@dataclass(frozen=True)
class Part:
    """One checkpoint layer inside a merged one: its name beside the merged layer (``q_proj``), the rows of
    its full output (``size`` of them) that this rank holds."""

    name: str
    rows: range
    size: int


class MergedColumnLinear(nn.Module):
    """Several column-parallel layers over the same input as one GEMM: the parts' rows stacked in order,
    each part's own slice on a sharded rank (q, k and v each split by heads, gate and up each by halves)."""

    def __init__(self, in_features: int, parts: Sequence[Part], bias: bool) -> None:
        super().__init__()
        self.parts = tuple(parts)
        self.sizes = [len(p.rows) for p in self.parts]  # this rank's output width of each part
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.sizes))) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's initialisation (the parts share one fan-in, so one call covers them all): a model
        built without a checkpoint, as tests and make_model do, must not compute on uninitialised memory."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.weight.shape[1]) if self.weight.shape[1] > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

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


def qkv_projection(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool, tp: TensorParallel | None
) -> MergedColumnLinear:
    """q, k and v as one layer (``sizes`` gives this rank's q, k, v widths). Across ranks each holds
    ``num_heads / tp`` query heads and the KV heads they read: ``num_kv_heads / tp`` of them, or one
    replicated head when there are fewer KV heads than ranks."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    q_rows, kv_rows = range(q), range(kv)
    if tp is not None and tp.enabled:
        q_rows, kv_rows = even_split(q, tp), kv_head_rows(num_kv_heads, head_dim, tp)
    parts = [Part("q_proj", q_rows, q), Part("k_proj", kv_rows, kv), Part("v_proj", kv_rows, kv)]
    return MergedColumnLinear(hidden, parts, bias)


def gate_up_projection(
    hidden: int, intermediate: int, bias: bool, tp: TensorParallel | None
) -> MergedColumnLinear:
    """The MLP's gate and up as one layer: [gate; up], each split on its own across ranks."""
    rows = even_split(intermediate, tp) if tp is not None and tp.enabled else range(intermediate)
    return MergedColumnLinear(
        hidden, [Part("gate_proj", rows, intermediate), Part("up_proj", rows, intermediate)], bias
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


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor (``shard`` of it, or all of it when None) and where it goes: ``rows`` of model
    parameter ``param`` (all of it when None)."""

    name: str
    shard: Shard | None
    param: str
    rows: slice | None = None


def checkpoint_pieces(model: nn.Module) -> list[Piece]:
    """What to read from the checkpoint to fill every parameter of ``model`` (a tied head once, as the
    embedding), in module order, a merged layer's parts one after another as the checkpoint lists them."""
    unique = {name for name, _ in model.named_parameters()}
    shards = shard_map(model)
    pieces: list[Piece] = []
    for prefix, module in model.named_modules():
        names = [
            (local, f"{prefix}.{local}" if prefix else local)
            for local, _ in module.named_parameters(recurse=False)
        ]
        names = [(local, full) for local, full in names if full in unique]
        if not isinstance(module, MergedColumnLinear):
            pieces.extend(Piece(full, shards.get(full), full) for _, full in names)
            continue
        parent = prefix.rpartition(".")[0]
        start = 0
        for part in module.parts:
            whole = part.rows == range(part.size)
            shard = None if whole else Shard(0, part.rows.start, part.rows.stop)
            rows = slice(start, start + len(part.rows))
            for local, full in names:
                name = f"{parent}.{part.name}.{local}" if parent else f"{part.name}.{local}"
                pieces.append(Piece(name, shard, full, rows))
            start += len(part.rows)
    return pieces


def checkpoint_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for an unsharded ``model`` (on the meta device is enough)."""
    params = dict(model.named_parameters())
    out: dict[str, tuple[int, ...]] = {}
    for piece in checkpoint_pieces(model):
        param = params[piece.param]
        out[piece.name] = tuple(param.shape if piece.rows is None else param[piece.rows].shape)
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
