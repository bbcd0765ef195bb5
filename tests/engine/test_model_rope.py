"""Rotary embeddings: inverse frequencies bit for bit equal to transformers', and per-token positions."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding, apply_rotary, inv_freq, rotate_half

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

BASE: dict[str, Any] = dict(
    vocab_size=32,
    hidden_size=512,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    max_position_embeddings=4096,
)
SCALINGS: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    {"rope_type": "llama3", "factor": 32, "low_freq_factor": 2, "high_freq_factor": 16},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=["default", "linear", "llama3", "llama3-int-factors"])
@pytest.mark.parametrize("theta", [10000.0, 500000])
def test_inverse_frequencies_equal_transformers(scaling: dict[str, Any] | None, theta: float) -> None:
    hf_config = transformers.LlamaConfig(**BASE, rope_theta=theta, rope_scaling=scaling)
    if scaling is None:
        expected, _ = (
            transformers.models.llama.modeling_llama.LlamaRotaryEmbedding.compute_default_rope_parameters(
                hf_config
            )
        )
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, "cpu")
    raw = {**BASE, "architectures": ["LlamaForCausalLM"], "rope_theta": theta, "rope_scaling": scaling}
    ours = inv_freq(ModelConfig.from_hf(raw))
    assert ours.dtype == torch.float32 and ours.shape == (64,)
    assert torch.equal(ours, expected)


def test_each_token_uses_its_own_position() -> None:
    """A flattened step of two sequences equals rotating each sequence on its own."""
    config = ModelConfig.from_hf({**BASE, "architectures": ["LlamaForCausalLM"]})
    rotary = RotaryEmbedding(config)
    x = torch.randn(7, 2, 128)
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 12])  # a 4-token prefill, then a chunk at 10..12
    cos, sin = rotary.cos_sin(positions, torch.float32)
    together = apply_rotary(x, cos, sin)
    cos_b, sin_b = rotary.cos_sin(torch.arange(10, 13), torch.float32)
    torch.testing.assert_close(together[4:], apply_rotary(x[4:], cos_b, sin_b), atol=0, rtol=0)
    # position 0 is the identity, and rotation keeps each pair's norm
    torch.testing.assert_close(together[0], x[0])
    torch.testing.assert_close(together.norm(dim=-1), x.norm(dim=-1))
    assert torch.equal(rotate_half(rotate_half(x)), -x)
