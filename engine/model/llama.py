"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module names follow Hugging Face exactly (``model.layers.N.self_attn.q_proj`` ...), so a transformers state
dict loads with ``strict=True``. A step is flattened: ``input_ids`` and ``positions`` are [T] for T tokens
from any number of sequences; ``AttentionMetadata`` says which sequence each token belongs to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, KVCache, paged_attention
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalize in float32, cast back, then scale in the input dtype.
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(hidden, config.num_attention_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, config.num_key_value_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * d, hidden, bias=config.o_proj_bias)
        self.q_norm: RMSNorm | None = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)  # [T, Hq, D]
        k = self.k_proj(x).view(t, -1, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(nn.Module):
    """The ``model.`` prefix of the checkpoint: embeddings, layers and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # computed once per step, shared by every layer
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache.layer(i), meta)
            kv_cache.layer_stored(i)
        return self.norm(x)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` when the config says so (call again after ``to_empty``)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run one flattened step: store its K/V in ``kv_cache`` and return every token's hidden state."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; the caller picks the rows it samples from."""
        return self.lm_head(hidden).float()
