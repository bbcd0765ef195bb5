"""Random inputs for the kernel tests, at any size and on any device: the CPU tests (Triton's interpreter,
tiny shapes) and the GPU tests (full size) build the same cases."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
