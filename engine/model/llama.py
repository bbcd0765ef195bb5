"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache.

Module names follow Hugging Face, except that q/k/v and gate/up are merged (``self_attn.qkv_proj``,
``mlp.gate_up_proj``): four GEMMs a layer instead of seven. The loader fills the merged weights from the
checkpoint's separate tensors (``engine.parallel.layers.checkpoint_pieces``). A step is flattened:
``input_ids`` and ``positions`` are [T] for T tokens from any number of sequences; ``AttentionMetadata``
says which sequence each token belongs to.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, KVCache, paged_attention
from engine.kernels import ops
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding
from engine.parallel.distributed import RankPlacement, TensorParallel
from engine.parallel.layers import embedding, gate_up_projection, lm_head, qkv_projection, row_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalize in float32, cast back, then scale in the input dtype.
        return ops.rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (norm(x + residual), x + residual), in one pass over memory on the Triton path."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.scale = d**-0.5
        self.qkv_proj = qkv_projection(
            hidden, config.num_attention_heads, config.num_key_value_heads, d, config.attention_bias, tp
        )  # with tp > 1, this rank's heads only
        self.sizes = self.qkv_proj.sizes  # this rank's q, k and v widths
        self.o_proj = row_linear(config.num_attention_heads * d, hidden, config.o_proj_bias, tp)
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
        # Strided views of one [T, q + 2 kv] output: the kernels read rows at any stride
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, -1, self.head_dim)  # [T, Hq, D]
        k = k.view(t, -1, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, cos, sin)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        projected: torch.Tensor = self.o_proj(out.reshape(t, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = gate_up_projection(hidden, inter, bias, tp)  # [gate; up], this rank's halves
        self.down_proj = row_linear(inter, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        down: torch.Tensor = self.down_proj(ops.silu_and_mul(gate, up))
        return down


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, tp)
        self.mlp = MLP(config, tp)
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
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv, meta)
        h, x = self.post_attention_layernorm.add_and_norm(attended, x)  # x + attended, and its norm
        mlp: torch.Tensor = self.mlp(h)
        return x + mlp


class MissingLayer(nn.Module):
    """A pipeline stage's stand-in for a layer another stage holds: keeps the layer numbers (and so the
    checkpoint names) of the layers it does hold."""


class Model(nn.Module):
    """The ``model.`` prefix of the checkpoint: embeddings, layers and the final norm. A pipeline stage
    holds its own layers only; the first stage embeds and the last one applies the final norm."""

    def __init__(self, config: ModelConfig, placement: RankPlacement | None = None) -> None:
        super().__init__()
        tp = placement.tp if placement else None
        self.stage_layers = placement.layers if placement else range(config.num_hidden_layers)
        first = placement is None or placement.is_first_stage
        last = placement is None or placement.is_last_stage
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size, tp) if first else None
        self.layers = nn.ModuleList(
            DecoderLayer(config, tp) if i in self.stage_layers else MissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        self.rotary = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # a later pipeline stage's input: the previous stage's output
    ) -> torch.Tensor:
        if hidden is None:
            assert self.embed_tokens is not None, "only the first pipeline stage embeds tokens"
            x: torch.Tensor = self.embed_tokens(input_ids)  # [T, hidden]
        else:
            x = hidden
        cos, sin = self.rotary.cos_sin(positions, x.dtype)  # computed once per step, shared by every layer
        first = self.stage_layers.start  # the stage's KV cache holds its own layers, from 0
        for i in self.stage_layers:
            x = self.layers[i](x, cos, sin, kv_cache.layer(i - first), meta)
            kv_cache.layer_stored(i - first)
        if self.norm is None:
            return x
        normed: torch.Tensor = self.norm(x)
        return normed


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig, placement: RankPlacement | None = None) -> None:
        """The whole model, or with ``placement`` one rank's part of it (its stage, its tensor shard)."""
        super().__init__()
        self.config = config
        self.model = Model(config, placement)
        tp, last = (placement.tp, placement.is_last_stage) if placement else (None, True)
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp) if last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` when the config says so (call again after ``to_empty``).
        A last pipeline stage without the embedding loads its own copy instead."""
        embed = self.model.embed_tokens
        if self.config.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long
        positions: torch.Tensor,  # [T] long
        kv_cache: KVCache,
        meta: AttentionMetadata,
        hidden: torch.Tensor | None = None,  # [T, hidden] from the previous pipeline stage
    ) -> torch.Tensor:  # [T, hidden], after the final norm (before it on all but the last stage)
        """Run one flattened step: store its K/V in ``kv_cache`` and return every token's hidden state."""
        out: torch.Tensor = self.model(input_ids, positions, kv_cache, meta, hidden)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]; the caller picks the rows it samples from."""
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        logits: torch.Tensor = self.lm_head(hidden)
        return logits.float()
