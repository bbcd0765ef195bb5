"""``ModelConfig``: both transformers spellings, per-architecture differences, and refusals that say why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.model.config import ModelConfig, RopeScaling
from engine.model.errors import ModelLoadError


def llama(**overrides: Any) -> dict[str, Any]:
    """A Llama-3.1-8B-like config.json; an override of None removes the key."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    raw.update(overrides)
    return {k: v for k, v in raw.items() if v is not None}


def test_llama3_in_the_4x_spelling() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = ModelConfig.from_hf(llama(rope_scaling=scaling))
    assert (config.head_dim, config.num_key_value_heads, config.rms_norm_eps) == (128, 8, 1e-5)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert config.eos_token_id == (128001, 128008, 128009) and config.bos_token_id == 128000
    assert config.torch_dtype == "bfloat16"
    assert not (config.attention_bias or config.o_proj_bias or config.qk_norm or config.tie_word_embeddings)


def test_the_5x_spelling_rope_parameters_and_dtype() -> None:
    raw = llama(rope_theta=None, torch_dtype=None, eos_token_id=2, dtype="float32")
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 4, "rope_theta": 10000.0}
    config = ModelConfig.from_hf(raw)
    assert config.rope_scaling == RopeScaling("linear", 4.0)
    assert (config.rope_theta, config.torch_dtype, config.eos_token_id) == (10000.0, "float32", (2,))


def test_defaults_follow_transformers() -> None:
    raw = llama(
        num_key_value_heads=None, rms_norm_eps=None, rope_theta=None, torch_dtype=None, eos_token_id=None
    )
    raw["rope_scaling"] = {"type": "linear", "factor": 2.0}  # the oldest key for the rope type
    config = ModelConfig.from_hf(raw)
    assert (config.num_key_value_heads, config.rms_norm_eps, config.rope_theta) == (32, 1e-6, 10000.0)
    assert (config.torch_dtype, config.eos_token_id, config.rope_scaling) == (
        "float32",
        (),
        RopeScaling("linear", 2.0),
    )
    # llama3 without original_max_position_embeddings uses max_position_embeddings, as transformers does
    raw["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    }
    assert ModelConfig.from_hf(raw).rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 131072)


def test_bias_and_norm_layout_per_architecture() -> None:
    qwen2 = ModelConfig.from_hf(llama(architectures=["Qwen2ForCausalLM"], use_sliding_window=False))
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_hf(llama(architectures=["Qwen3ForCausalLM"], hidden_size=1024, head_dim=128))
    assert (qwen3.attention_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    # Qwen3Config's head_dim default is 128, not hidden_size / heads
    assert ModelConfig.from_hf(llama(architectures=["Qwen3ForCausalLM"], hidden_size=1024)).head_dim == 128
    biased = ModelConfig.from_hf(llama(attention_bias=True, mlp_bias=True))
    assert (biased.attention_bias, biased.o_proj_bias, biased.mlp_bias) == (True, True, True)
    raw = llama(architectures=["MistralForCausalLM"], attention_bias=True)
    raw["sliding_window"] = None  # llama() drops None values; Mistral-v0.2+ spells "no window" as null
    mistral = ModelConfig.from_hf(raw)
    assert (mistral.attention_bias, mistral.o_proj_bias, mistral.mlp_bias) == (False, False, False)


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (llama(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (llama(architectures=None), "no 'architectures'"),
        (llama(hidden_size=None), "'hidden_size' is missing"),
        (llama(num_hidden_layers="32"), "'num_hidden_layers' is missing or not a positive integer"),
        (llama(num_key_value_heads=5), "not a multiple of num_key_value_heads=5"),
        (llama(hidden_size=100, num_attention_heads=3, num_key_value_heads=3), "no head_dim"),
        (llama(hidden_act="gelu"), "hidden_act 'gelu'"),
        (llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope type 'yarn' is not supported"),
        (llama(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope type 'dynamic' is not supported"),
        (llama(rope_scaling={"rope_type": "linear"}), "needs a number 'factor'"),
        (llama(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs a number 'low_freq_factor'"),
        (llama(partial_rotary_factor=0.5), "partial rotary"),
        (llama(torch_dtype="float8_e4m3fn"), "dtype 'float8_e4m3fn' is not supported"),
        (llama(architectures=["MistralForCausalLM"]), "sliding-window attention (sliding_window=4096)"),
        (llama(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "use_sliding_window"),
        (llama(layer_types=["sliding_attention"] * 32), "only full-attention layers"),
        (llama(eos_token_id="</s>"), "eos_token_id must be integers"),
    ],
)
def test_refusals_name_the_source_and_the_reason(raw: dict[str, Any], why: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_hf(raw, source="somewhere/config.json")
    assert str(info.value).startswith("somewhere/config.json: ")
    assert why in str(info.value)


def test_from_dir(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a readable JSON file") as info:
        ModelConfig.from_dir(tmp_path)
    assert str(path) in str(info.value)
    path.write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="expected a JSON object"):
        ModelConfig.from_dir(tmp_path)
    path.write_text(json.dumps(llama()))
    assert ModelConfig.from_dir(tmp_path) == ModelConfig.from_hf(llama())
