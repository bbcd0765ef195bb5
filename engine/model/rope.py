"""Rotary position embeddings in the Hugging Face convention (``rotate_half``), one position id per token.

Because cos/sin are looked up per token from its own position, a flattened step that mixes sequences and
chunks needs nothing special. The inverse frequencies are computed the way transformers computes them
(``modeling_rope_utils.py``: same ops, same order, float32 on the CPU), so they agree bit for bit.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.rotary import apply_rotary_torch as apply_rotary
from engine.kernels.rotary import rotate_half
from engine.model.config import ModelConfig

__all__ = ["RotaryEmbedding", "apply_rotary", "inv_freq", "rotate_half"]


def inv_freq(config: ModelConfig) -> torch.Tensor:  # [head_dim // 2] float32, CPU
    dim = config.head_dim
    # device="cpu" on purpose: the model may be built under torch.device("meta"), and the frequencies must
    # be real numbers computed where transformers computes them.
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim
    freqs = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return freqs / scaling.factor
    assert scaling.rope_type == "llama3", scaling
    assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
    assert scaling.original_max_position_embeddings is not None
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / freqs
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / factor, freqs)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin for a step's positions. Not an ``nn.Module``: it has no weights, and its frequencies must
    survive the loader's meta-device construction, so it keeps them on the CPU and caches one copy per
    device."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = inv_freq(config)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _freqs_on(self, device: torch.device) -> torch.Tensor:
        freqs = self._on_device.get(device)
        if freqs is None:
            freqs = self._on_device[device] = self.inv_freq.to(device)
        return freqs

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` [T] long -> cos, sin [T, head_dim] in ``dtype`` (computed in float32 first)."""
        freqs = positions.float()[:, None] * self._freqs_on(positions.device)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)
