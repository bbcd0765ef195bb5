"""How many KV cache blocks to allocate.

An explicit block count (``--kv-blocks``) wins, then an explicit size (``--kv-memory-gib``). Otherwise, on
CUDA, the cache takes what ``--gpu-memory-utilization`` (vLLM's option and default, 0.9) leaves once the
model is loaded: that fraction of the device's memory, less everything in use on it then (weights, this
process' CUDA context, other processes), less what a step allocates at its peak (measured by a dummy
forward when the caller can run one, else :func:`activation_reserve_bytes`). On CPU there is nothing to
profile: the cache keeps its explicit default size.

Arithmetic only, no torch import: :func:`cuda_memory_info` and :func:`measured_peak_bytes` are the two
calls that touch the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.model.config import ModelConfig

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_KV_MEMORY_GIB = 0.5  # the size without profiling (CPU), as before the option existed
GIB = 2**30
# Held back on top of the activation estimate: the caching allocator's fragmentation, and the cuBLAS and
# Triton workspaces and NCCL buffers that the first real step allocates.
FIXED_RESERVE_BYTES = 512 * 2**20


class KvCacheSizingError(ValueError):
    """Not even one KV block fits in the memory the options leave."""


def kv_blocks_for_memory(
    *, free_bytes: int, total_bytes: int, bytes_per_block: int, utilization: float, reserve_bytes: int = 0
) -> int:
    """The blocks that fit in ``utilization`` x ``total_bytes`` once what is in use on the device
    (``total_bytes - free_bytes``, read after the model is loaded) and ``reserve_bytes`` (a step's
    activations) are set aside; 0 when none fit."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must lie in (0, 1], got {utilization}")
    if bytes_per_block < 1 or not 0 <= free_bytes <= total_bytes or reserve_bytes < 0:
        raise ValueError(
            f"need bytes_per_block >= 1, 0 <= free_bytes <= total_bytes and reserve_bytes >= 0, got "
            f"{bytes_per_block}, {free_bytes}, {total_bytes}, {reserve_bytes}"
        )
    budget = math.floor(total_bytes * utilization) - (total_bytes - free_bytes) - reserve_bytes
    return max(0, budget // bytes_per_block)


def activation_reserve_bytes(
    mc: ModelConfig,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    element_size: int,
    tensor_parallel_size: int = 1,
) -> int:
    """A generous estimate of a step's peak beyond weights and KV cache, for when no dummy forward could be
    measured: per token of the largest step, one layer's live tensors (residual stream, its normed copy,
    attention output, q/k/v, the MLP's gate and up halves and their product) twice over for the temporaries
    between them; float32 logits for every sequence a few times over (the sampler's copies); and
    :data:`FIXED_RESERVE_BYTES`."""
    tp = tensor_parallel_size
    qkv = (mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim // tp
    per_token = (3 * mc.hidden_size + qkv + 3 * mc.intermediate_size // tp) * element_size
    logits = max_num_seqs * mc.vocab_size * 4 * 4
    return 2 * max_num_batched_tokens * per_token + logits + FIXED_RESERVE_BYTES


def kv_cache_blocks(
    *,
    bytes_per_block: int,
    on_cuda: bool,
    num_kv_blocks: int | None = None,
    kv_memory_gib: float | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    memory_info: Callable[[], tuple[int, int]] | None = None,
    reserve_bytes: int = 0,
) -> int:
    """The KV cache's block count (see the module's docstring for the order of the options).
    ``memory_info`` returns the device's (free, total) bytes, called only when the cache is profiled;
    ``reserve_bytes`` is the measured or estimated step peak. Raises :class:`KvCacheSizingError` when the
    profiled memory holds no block."""
    if num_kv_blocks:
        return num_kv_blocks
    if kv_memory_gib is not None or not on_cuda:
        gib = DEFAULT_KV_MEMORY_GIB if kv_memory_gib is None else kv_memory_gib
        return max(1, int(gib * GIB) // bytes_per_block)
    if memory_info is None:
        raise ValueError("profiling the KV cache on CUDA needs memory_info (e.g. cuda_memory_info(device))")
    free, total = memory_info()
    blocks = kv_blocks_for_memory(
        free_bytes=free,
        total_bytes=total,
        bytes_per_block=bytes_per_block,
        utilization=gpu_memory_utilization,
        reserve_bytes=reserve_bytes,
    )
    if blocks < 1:
        raise KvCacheSizingError(
            f"no room for a KV block: {free / GIB:.2f} of {total / GIB:.2f} GiB free after loading the "
            f"model, {gpu_memory_utilization:g} of it may be used, {reserve_bytes / GIB:.2f} GiB are kept "
            f"for a step's activations and a block takes {bytes_per_block} bytes; raise "
            "--gpu-memory-utilization, lower --max-batched-tokens, or give --kv-blocks"
        )
    return blocks


def cuda_memory_info(device: torch.device) -> Callable[[], tuple[int, int]]:
    """``memory_info`` for :func:`kv_cache_blocks`: the device's (free, total) bytes, with this process'
    cached but unused allocator blocks returned first so that they count as free."""

    def read() -> tuple[int, int]:
        import torch

        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return int(free), int(total)

    return read


def measured_peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """What ``step`` (a dummy forward of the largest batch, its results dropped on return) allocates at its
    peak beyond what was allocated before it, on a CUDA device: the ``reserve_bytes`` to keep."""
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return max(0, torch.cuda.max_memory_allocated(device) - before)
