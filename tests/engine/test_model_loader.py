"""``load_model``: single file, shards, tied embeddings, dtypes, and a ``ModelLoadError`` for each failure."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.llama import CausalLM
from engine.model.loader import checkpoint_state, load_model
from engine.parallel.layers import checkpoint_shapes

CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


def random_state(raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``raw`` holds: every parameter once, a tied lm_head left out."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_hf(raw))
    return {name: torch.randn(shape) for name, shape in checkpoint_shapes(model).items()}


def write(directory: Path, state: dict[str, torch.Tensor], raw: dict[str, Any] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(raw or CONFIG))
    save_file(state, str(directory / "model.safetensors"))
    return directory


def write_sharded(directory: Path, state: dict[str, torch.Tensor]) -> Path:
    """Two shards and an index, as transformers writes a large checkpoint."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({n: state[n] for n in shard_names}, str(directory / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def assert_holds(model: CausalLM, state: dict[str, torch.Tensor]) -> None:
    params = checkpoint_state(model)  # q/k/v and gate/up read back out of the merged layers
    assert set(params) == set(state)
    for name, tensor in state.items():
        assert torch.equal(params[name].float(), tensor.float()), name


def test_loads_a_single_file(tmp_path: Path) -> None:
    state = random_state(CONFIG)
    model, config = load_model(write(tmp_path / "m", state))
    assert config.architecture == "Qwen3ForCausalLM" and not model.training
    assert "model.layers.1.self_attn.k_norm.weight" in state
    assert_holds(model, state)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_loads_shards(tmp_path: Path) -> None:
    state = random_state(CONFIG)
    model, _ = load_model(write_sharded(tmp_path / "m", state))
    assert_holds(model, state)


def test_tied_embeddings_need_no_lm_head_and_ignore_old_buffers(tmp_path: Path) -> None:
    raw = {**CONFIG, "tie_word_embeddings": True}
    state = random_state(raw)
    assert "lm_head.weight" not in state
    model, _ = load_model(write(tmp_path / "a", state, raw))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_holds(model, state)
    # a stored copy of the tied head and rotary buffers of old checkpoints are skipped, not refused
    extra = {
        **state,
        "lm_head.weight": torch.zeros(96, 32),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8),
    }
    model, _ = load_model(write(tmp_path / "b", extra, raw))
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_dtype_comes_from_the_config_unless_given(tmp_path: Path) -> None:
    state = {name: t.to(torch.bfloat16) for name, t in random_state(CONFIG).items()}
    directory = write(tmp_path / "m", state, {**CONFIG, "torch_dtype": "bfloat16"})
    model, _ = load_model(directory)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_holds(model, state)
    model, _ = load_model(directory, dtype=torch.float32)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert_holds(model, state)  # bf16 -> fp32 is exact


def expect_error(directory: Path, *fragments: str) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(directory)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_directory_and_files(tmp_path: Path) -> None:
    expect_error(tmp_path / "nowhere", "nowhere: no such model directory")
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", "no config.json")
    directory = write(tmp_path / "m", random_state(CONFIG))
    (directory / "model.safetensors").unlink()
    expect_error(directory, "no weights, neither model.safetensors nor model.safetensors.index.json")
    (directory / "pytorch_model.bin").write_bytes(b"")
    expect_error(directory, "found pytorch_model.bin: only safetensors is supported")


def test_unsupported_architecture(tmp_path: Path) -> None:
    directory = write(tmp_path / "m", {}, {**CONFIG, "architectures": ["MambaForCausalLM"]})
    expect_error(directory, "config.json: unsupported architecture 'MambaForCausalLM'")


def test_missing_shard(tmp_path: Path) -> None:
    directory = write_sharded(tmp_path / "m", random_state(CONFIG))
    (directory / "model-00002-of-00002.safetensors").unlink()
    expect_error(
        directory, "model.safetensors.index.json", "shard 'model-00002-of-00002.safetensors' is missing"
    )
    (directory / "model.safetensors.index.json").write_text('{"metadata": {}}')
    expect_error(directory, "not a safetensors index with a 'weight_map'")


def test_missing_tensors_are_named_and_counted(tmp_path: Path) -> None:
    state = random_state(CONFIG)
    del state["model.layers.1.mlp.up_proj.weight"]
    expect_error(write(tmp_path / "one", state), "1 tensors missing", "model.layers.1.mlp.up_proj.weight")
    layer1 = [name for name in state if name.startswith("model.layers.1.")]
    message = expect_error(write(tmp_path / "many", {n: t for n, t in state.items() if n not in layer1}))
    assert f"{len(layer1) + 1} tensors missing" in message and f"and {len(layer1) + 1 - 5} more" in message


def test_unexpected_tensor(tmp_path: Path) -> None:
    state = {**random_state(CONFIG), "model.layers.2.mlp.up_proj.weight": torch.zeros(48, 32)}
    expect_error(write(tmp_path / "m", state), "1 unexpected tensors", "model.layers.2.mlp.up_proj.weight")


def test_shape_mismatch(tmp_path: Path) -> None:
    state = random_state(CONFIG)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 32)
    expect_error(
        write(tmp_path / "m", state),
        "model.safetensors: tensor model.layers.0.self_attn.k_proj.weight has shape [64, 32]",
        "the config expects [32, 32]",
    )


def test_quantized_tensor(tmp_path: Path) -> None:
    state = random_state(CONFIG)
    state["model.norm.weight"] = torch.zeros(32, dtype=torch.int8)
    expect_error(write(tmp_path / "m", state), "model.norm.weight is I8; quantized weights are not supported")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_file(tmp_path: Path, damage: str) -> None:
    directory = write(tmp_path / "m", random_state(CONFIG))
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"garbage": b"\x07" * 64, "truncated": data[: len(data) // 2], "empty": b""}[damage])
    expect_error(directory, f"{path}: corrupt")
