"""The model against transformers: same logits, same greedy tokens through the paged cache, and the cache
paths (chunked prefill, batched sequences) agreeing with one plain step."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from engine.attention import KVCache, SeqSlice, build_metadata
from engine.model.config import ModelConfig
from engine.model.llama import CausalLM, DecoderLayer
from engine.model.loader import checkpoint_state, load_model, load_state_dict
from engine.parallel.layers import MergedColumnLinear

transformers = pytest.importorskip("transformers")

VOCAB = 256
BLOCK = 8
PROMPT = 40
NEW_TOKENS = 32
TABLE = [9, 3, 14, 0, 7, 11, 5, 2, 12]  # non-contiguous on purpose: 9 blocks of 8 hold 72 tokens
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,  # generate() must not stop early
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # below the 72 positions generated, so the scaling matters
}
CONFIGS: dict[str, Callable[[], Any]] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "llama3-rope-tied": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True
    ),
    "llama-linear-rope-bias": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}, attention_bias=True, mlp_bias=True
    ),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=32),  # head_dim != hidden / heads
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A transformers model with every weight random (biases and norms too), saved in fp32."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            # std 0.1 keeps greedy decoding varied and the top-2 logit gaps far above float32 noise
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.1 * noise)
    directory = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(directory)
    return directory, hf


def new_cache(config: ModelConfig, dtype: torch.dtype = torch.float32) -> KVCache:
    return KVCache(config.num_hidden_layers, 16, BLOCK, config.num_key_value_heads, config.head_dim, dtype)


def step(
    model: CausalLM, cache: KVCache, parts: Sequence[tuple[Sequence[int], int, torch.Tensor]]
) -> torch.Tensor:
    """One flattened step over (block table, tokens cached, new token ids) per sequence -> logits [T, V]."""
    ids = torch.cat([tokens for _, _, tokens in parts])
    positions = torch.cat([torch.arange(done, done + len(tokens)) for _, done, tokens in parts])
    meta = build_metadata([SeqSlice(table, done, len(tokens)) for table, done, tokens in parts], BLOCK)
    return model.compute_logits(model(ids, positions, cache, meta))


def prompt(seed: int = 2, length: int = PROMPT) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_transformers_state_dict_loads_strictly(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    model = CausalLM(ModelConfig.from_dir(directory))
    load_state_dict(model, hf.state_dict())
    theirs = hf.state_dict()
    ours = checkpoint_state(model)
    assert set(ours) == set(theirs) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


def test_a_loaded_layer_runs_four_merged_gemms(checkpoint: tuple[Path, Any]) -> None:
    """One qkv_proj and one gate_up_proj per layer, their rows q, k, v and gate, up as the checkpoint's."""
    directory, hf = checkpoint
    model, config = load_model(directory)
    layer = cast(DecoderLayer, model.model.layers[1])
    linears = sorted(
        name for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear | MergedColumnLinear)
    )
    assert linears == ["mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj", "self_attn.qkv_proj"]
    theirs = hf.model.layers[1]
    attn, mlp = theirs.self_attn, theirs.mlp
    qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    if attn.q_proj.bias is not None:  # Qwen2's q/k/v biases merge too
        bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        assert layer.self_attn.qkv_proj.bias is not None
        assert torch.equal(layer.self_attn.qkv_proj.bias, bias)
    else:
        assert layer.self_attn.qkv_proj.bias is None
    if config.qk_norm:  # Qwen3's per-head norms stay their own modules
        assert layer.self_attn.q_norm is not None and layer.self_attn.k_norm is not None
        assert torch.equal(layer.self_attn.q_norm.weight, attn.q_norm.weight)
        assert torch.equal(layer.self_attn.k_norm.weight, attn.k_norm.weight)


@torch.inference_mode()
def test_prefill_logits_match_transformers(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    model, config = load_model(directory)
    ids = prompt()
    ours = step(model, new_cache(config), [(TABLE, 0, ids)])
    theirs = hf(ids[None]).logits[0].float()
    assert ours.dtype == torch.float32 and ours.shape == (PROMPT, VOCAB)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@torch.inference_mode()
def test_greedy_decoding_through_the_cache_matches_generate(checkpoint: tuple[Path, Any]) -> None:
    directory, hf = checkpoint
    model, config = load_model(directory)
    cache = new_cache(config)
    ids = prompt()
    expected = hf.generate(ids[None], do_sample=False, max_new_tokens=NEW_TOKENS)[0, PROMPT:].tolist()

    logits = step(model, cache, [(TABLE, 0, ids)])[-1]
    tokens = [int(logits.argmax())]
    while len(tokens) < NEW_TOKENS:
        done = PROMPT + len(tokens) - 1  # the last token is not in the cache yet
        logits = step(model, cache, [(TABLE, done, torch.tensor(tokens[-1:]))])[-1]
        tokens.append(int(logits.argmax()))
    assert len(expected) == NEW_TOKENS
    assert tokens == expected


@torch.inference_mode()
def test_chunked_prefill_matches_one_step(checkpoint: tuple[Path, Any]) -> None:
    directory, _ = checkpoint
    model, config = load_model(directory)
    ids = prompt()
    whole = step(model, new_cache(config), [(TABLE, 0, ids)])
    cache = new_cache(config)
    chunks = [
        step(model, cache, [(TABLE, start, ids[start:end])]) for start, end in ((0, 16), (16, 32), (32, 40))
    ]
    torch.testing.assert_close(torch.cat(chunks), whole, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_batched_sequences_match_each_alone(checkpoint: tuple[Path, Any]) -> None:
    directory, _ = checkpoint
    model, config = load_model(directory)
    a, b = prompt(3, 29), prompt(4, 40)
    table_a, table_b = [4, 1, 15, 8], [6, 10, 13, 2, 0]
    alone_a = step(model, new_cache(config), [(table_a, 0, a)])
    alone_b = step(model, new_cache(config), [(table_b, 0, b)])
    # b's first 17 tokens went in an earlier step; now b's chunk and all of a share one step
    cache = new_cache(config)
    step(model, cache, [(table_b, 0, b[:17])])
    together = step(model, cache, [(table_a, 0, a), (table_b, 17, b[17:])])
    torch.testing.assert_close(together[:29], alone_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(together[29:], alone_b[17:], atol=1e-5, rtol=0)


@torch.inference_mode()
def test_bfloat16_runs_close_to_float32(checkpoint: tuple[Path, Any]) -> None:
    directory, _ = checkpoint
    model, config = load_model(directory, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    ids = prompt()
    ours = step(model, new_cache(config, torch.bfloat16), [(TABLE, 0, ids)])
    fp32 = step(load_model(directory)[0], new_cache(config), [(TABLE, 0, ids)])
    assert ours.dtype == torch.float32 and torch.isfinite(ours).all()
    # bf16 keeps 8 bits of mantissa: compare on the scale of the logits, and check the ranking mostly holds
    scale = float(fp32.abs().max())
    assert float((ours - fp32).abs().max()) < 0.1 * scale
    assert float((ours.argmax(-1) == fp32.argmax(-1)).float().mean()) > 0.8
    # against transformers in bf16 the ops are the same ones in the same order (identical on CPU today)
    hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    torch.testing.assert_close(ours, hf_bf16(ids[None]).logits[0].float(), atol=0.02 * scale, rtol=0)


def test_a_model_built_without_a_checkpoint_starts_from_nn_linears_initialisation() -> None:
    """The merged projections are initialised as nn.Linear is: a model built in memory (tests, make_model)
    computed on uninitialised memory when they were not (NaN logits, depending on what the allocator held)."""
    config = ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=64, attention_bias=True)  # fmt: skip
    layer = CausalLM(config).model.layers[0]
    for merged in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
        bound = 1 / math.sqrt(merged.weight.shape[1])
        for tensor in (merged.weight, merged.bias):
            if tensor is None:
                continue
            assert torch.isfinite(tensor).all() and tensor.abs().max() <= bound + 1e-6
            assert tensor.std() > bound / 10  # drawn, not left at zeros
