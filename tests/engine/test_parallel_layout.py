"""The parts of tp x pp that need no process group: which layers and heads each rank holds, how a step is cut
into micro-batches, and that the shards the loader reads put the full checkpoint back together."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.model.config import ModelConfig
from engine.model.llama import DecoderLayer
from engine.model.loader import load_model
from engine.parallel.distributed import (
    ParallelConfig,
    ParallelConfigError,
    TensorParallel,
    check_parallel,
    placement_for,
    stage_layers,
)
from engine.parallel.layers import Shard, checkpoint_pieces, kv_head_rows, read_shard
from engine.parallel.step_plan import MicroBatch, split_micro_batches
from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams, Sequence


def test_stages_hold_contiguous_layers_covering_the_model_once() -> None:
    assert [stage_layers(5, 2, s) for s in range(2)] == [range(0, 3), range(3, 5)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [list(stage_layers(4, 4, s)) for s in range(4)] == [[0], [1], [2], [3]]


def test_ranks_are_numbered_stage_major() -> None:
    parallel = ParallelConfig(2, 3)
    assert parallel.world_size == 6
    assert [parallel.place(r) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(parallel.rank(*parallel.place(r)) == r for r in range(6))
    with pytest.raises(ParallelConfigError, match="must be >= 1"):
        ParallelConfig(0, 1)


def model_config(heads: int = 8, kv_heads: int = 2, layers: int = 4, inter: int = 128) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 100,
            "hidden_size": 64,
            "intermediate_size": inter,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": 8,
            "max_position_embeddings": 64,
        }
    )


def test_layouts_the_model_cannot_take_are_refused_by_name() -> None:
    check_parallel(model_config(), ParallelConfig(2, 4))  # KV heads split one per rank, one layer per stage
    check_parallel(model_config(), ParallelConfig(8, 1))  # 2 KV heads replicated over 8 ranks
    cases = {
        "num_attention_heads=8 is not divisible by --tp 3": (model_config(), ParallelConfig(3, 1)),
        "num_key_value_heads=4 and --tp 6: one must divide the other": (
            model_config(heads=24, kv_heads=4),
            ParallelConfig(6, 1),
        ),
        "intermediate_size=100 is not divisible by --tp 8": (model_config(inter=100), ParallelConfig(8, 1)),
        "--pp 5 exceeds the model's 4 layers": (model_config(), ParallelConfig(1, 5)),
    }
    for message, (config, parallel) in cases.items():
        with pytest.raises(ParallelConfigError) as caught:
            check_parallel(config, parallel)
        assert message in str(caught.value)


def test_kv_heads_are_split_or_replicated_to_match_the_query_heads() -> None:
    d = 8
    split = [kv_head_rows(4, d, TensorParallel(2, r)) for r in range(2)]
    assert split == [range(0, 16), range(16, 32)]
    # 2 KV heads over 4 ranks: 8 query heads, 2 per rank; query heads 0-3 read KV head 0, 4-7 KV head 1.
    replicated = [kv_head_rows(2, d, TensorParallel(4, r)) for r in range(4)]
    assert replicated == [range(0, 8), range(0, 8), range(8, 16), range(8, 16)]


def scheduled(*sizes: int) -> list[ScheduledSeq]:
    out = []
    for i, n in enumerate(sizes):
        seq = Sequence(f"s{i}", list(range(n)), SamplingParams(), 0, block_table=[i])
        out.append(ScheduledSeq(seq, n, True))
    return out


def test_micro_batches_are_contiguous_nonempty_and_balanced_in_tokens() -> None:
    def cut(sizes: tuple[int, ...], n: int) -> list[list[int]]:
        return [[item.num_new for item in group] for group in split_micro_batches(scheduled(*sizes), n)]

    assert cut((4, 4, 4, 4), 2) == [[4, 4], [4, 4]]
    assert cut((30, 1, 1, 1), 2) == [[30], [1, 1, 1]]
    assert cut((1, 1, 1, 30), 2) == [[1, 1, 1], [30]]
    assert cut((1, 1), 4) == [[1], [1]]  # never more groups than sequences
    assert cut((5, 6, 7), 1) == [[5, 6, 7]]
    assert cut((1, 1, 1, 1, 1, 1), 3) == [[1, 1], [1, 1], [1, 1]]
    items = scheduled(1, 1, 1, 1, 1, 1, 1, 1)  # a decode step of 8 tokens
    assert len(split_micro_batches(items, 2, min_tokens=64)) == 1  # not worth re-reading the weights
    assert len(split_micro_batches(items, 2, min_tokens=4)) == 2


def test_a_micro_batch_flattens_its_sequences_in_order() -> None:
    items = scheduled(3, 2)
    items[1] = ScheduledSeq(items[1].seq, 2, False)  # a prefill chunk that does not sample
    mb = MicroBatch.of(items)
    assert mb.token_ids == [0, 1, 2, 0, 1]
    assert mb.sample_rows == [2]
    assert mb.seqs == [(items[0].seq.request_id, 0, 3), (items[1].seq.request_id, 0, 2)]


def test_reading_a_shard_pads_past_the_end_with_zeros(tmp_path: Path) -> None:
    full = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    save_file({"w": full}, tmp_path / "w.safetensors")
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        assert torch.equal(read_shard(f, "w", Shard(0, 0, 3)), full[:3])
        tail = read_shard(f, "w", Shard(0, 3, 6))
        assert torch.equal(tail[:2], full[3:]) and torch.equal(tail[2], torch.zeros(4))
        assert torch.equal(read_shard(f, "w", Shard(1, 2, 4)), full[:, 2:])


def reassembled(model_dir: Path, parallel: ParallelConfig) -> dict[str, torch.Tensor]:
    """Every rank's loaded parameters, their shards put back together under the checkpoint's names (a merged
    qkv_proj or gate_up_proj split into its parts). Ranks holding the same slice (a replicated norm, a
    replicated KV head) must hold the same values."""
    config = ModelConfig.from_dir(model_dir)
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    for rank in range(parallel.world_size):
        model, _ = load_model(model_dir, placement=placement_for(config, parallel, rank))
        params = dict(model.named_parameters())
        for piece in checkpoint_pieces(model):
            param = params[piece.param].detach()
            value = param if piece.rows is None else param[piece.rows]
            start = piece.shard.start if piece.shard else 0
            if piece.shard:
                dims[piece.name] = piece.shard.dim
            previous = pieces.setdefault(piece.name, {}).setdefault(start, value)
            assert torch.equal(previous, value), f"{piece.name}: ranks disagree on the same slice"
    out = {}
    for name, by_start in pieces.items():
        parts = [by_start[s] for s in sorted(by_start)]
        out[name] = torch.cat(parts, dim=dims[name]) if name in dims else parts[0]
    return out


def test_tp2_ranks_hold_their_heads_q_k_v_rows_and_their_halves_of_gate_and_up(tiny_model_dir: Path) -> None:
    full = load_file(tiny_model_dir / "model.safetensors")
    config = ModelConfig.from_dir(tiny_model_dir)
    d, q_heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    for rank in range(2):
        model, _ = load_model(tiny_model_dir, placement=placement_for(config, ParallelConfig(2, 1), rank))
        layer = cast(DecoderLayer, model.model.layers[1])
        assert not hasattr(layer.self_attn, "q_proj") and not hasattr(layer.mlp, "gate_proj")
        q = slice(rank * q_heads // 2 * d, (rank + 1) * q_heads // 2 * d)  # this rank's query heads
        kv = slice(rank * kv_heads // 2 * d, (rank + 1) * kv_heads // 2 * d)  # and the KV heads they read
        name = "model.layers.1.self_attn"
        expected = torch.cat(
            [full[f"{name}.{p}_proj.weight"][rows] for p, rows in (("q", q), ("k", kv), ("v", kv))]
        )
        assert torch.equal(layer.self_attn.qkv_proj.weight, expected)
        assert layer.self_attn.qkv_proj.sizes == [q.stop - q.start, kv.stop - kv.start, kv.stop - kv.start]
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        name = "model.layers.1.mlp"
        expected = torch.cat([full[f"{name}.gate_proj.weight"][half], full[f"{name}.up_proj.weight"][half]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, expected)


@pytest.mark.parametrize("layout", [(2, 1), (2, 2), (4, 1)])
def test_the_shards_of_all_ranks_are_exactly_the_checkpoint(
    tiny_model_dir: Path, layout: tuple[int, int]
) -> None:
    # (4, 1): the tiny model's 2 KV heads are each replicated on two ranks
    full = load_file(tiny_model_dir / "model.safetensors")
    got = reassembled(tiny_model_dir, ParallelConfig(*layout))
    assert set(got) == set(full)
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name


def test_a_tied_head_on_a_later_stage_reads_the_embedding(tiny_model_dir: Path, tmp_path: Path) -> None:
    tied = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied)
    weights = load_file(tied / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors")
    raw = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": True}))
    config = ModelConfig.from_dir(tied)
    half = embed.shape[0] // 2
    for rank, rows in ((2, slice(0, half)), (3, slice(half, None))):  # stage 1 of tp=2 x pp=2
        model, _ = load_model(tied, placement=placement_for(config, ParallelConfig(2, 2), rank))
        assert model.model.embed_tokens is None and model.lm_head is not None
        assert torch.equal(model.lm_head.weight, embed[rows])
    one_stage, _ = load_model(tied, placement=placement_for(config, ParallelConfig(2, 1), 1))
    assert one_stage.lm_head is not None and one_stage.model.embed_tokens is not None
    assert one_stage.lm_head.weight is one_stage.model.embed_tokens.weight  # tied shard to shard
