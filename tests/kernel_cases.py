"""Random inputs for the kernel tests, at any size and on any device: the CPU tests (Triton's interpreter,
tiny shapes) and the GPU tests (full size) build the same cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import KVCache, SeqSlice, build_metadata
from engine.model.config import ModelConfig
from engine.model.llama import CausalLM

# Compared against a float32 reference: fp32 kernels agree to rounding; fp16/bf16 outputs to their own ulp
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@dataclass
class PagedCache:
    k_cache: torch.Tensor  # [num_blocks * block_size, Hkv, D], every slot random (unused ones too)
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, blocks shuffled across sequences, padded with 0
    block_size: int


def paged_cache(
    lengths: list[int],
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    gen: torch.Generator,
    spare_blocks: int = 3,
) -> PagedCache:
    """A cache holding ``lengths[b]`` tokens for each sequence in blocks scattered at random."""
    needed = [-(-n // block_size) for n in lengths]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lengths), max(needed, default=0) or 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(needed):
        tables[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    shape = (num_blocks * block_size, kv_heads, head_dim)
    return PagedCache(
        randn(shape, dtype, device, gen), randn(shape, dtype, device, gen), tables.to(device), block_size
    )


def randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def int32(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def query_start(new_lens: list[int], device: torch.device | str) -> torch.Tensor:
    starts = [0]
    for n in new_lens:
        starts.append(starts[-1] + n)
    return int32(starts, device)


def tiny_qwen3(device: torch.device | str) -> CausalLM:
    """A random 2-layer model with q/k norms and grouped-query heads (the norms' weights random too)."""
    config = ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        qk_norm=True,
    )
    torch.manual_seed(0)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape))
    return model.to(device)


@torch.inference_mode()
def greedy(model: CausalLM, steps: int, block_size: int = 8) -> tuple[list[torch.Tensor], list[int]]:
    """A 13-token prompt in one step, then ``steps - 1`` decode steps -> (logits of each step, tokens)."""
    weight = next(model.parameters())
    device = weight.device
    config = model.config
    cache = KVCache(
        config.num_hidden_layers,
        4,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        weight.dtype if weight.dtype in (torch.float32, torch.bfloat16) else torch.float32,
        device,
    )
    table = [3, 0, 2]
    ids = torch.randint(0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(4))
    prompt_len = len(ids)
    logits: list[torch.Tensor] = []
    tokens: list[int] = []
    for _ in range(steps):
        done = 0 if not tokens else prompt_len + len(tokens) - 1
        meta = build_metadata([SeqSlice(table, done, len(ids))], block_size, device)
        positions = torch.arange(done, done + len(ids), device=device)
        logits.append(model.compute_logits(model(ids.to(device), positions, cache, meta)).cpu())
        tokens.append(int(logits[-1][-1].argmax()))
        ids = torch.tensor(tokens[-1:])
    return logits, tokens
