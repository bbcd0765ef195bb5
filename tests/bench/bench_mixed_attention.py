"""A mixed step's attention, old path (every row through the prefill kernel) against the split one (decode
rows through the decode kernel, the chunks through the prefill kernel), shaped like Llama-3-8B's attention
(32 query heads, 8 KV heads, head dim 128).

K/V bytes read are counted from the kernels' grids: the prefill kernel runs one program per query head, so
a decode row's context is read once per query head (32x here); the decode kernel runs one program per KV
head for its whole group (8x), split-K or not. Time is measured on ``--device``: on CPU that is the torch
references, which expand K/V per query head on both paths (``repeat_interleave``), so the CPU time does not
show the byte saving, only that the split costs no extra host work; on CUDA it times the Triton kernels.

    nice -n 19 .venv/bin/python tests/bench/bench_mixed_attention.py --decode 16 --context 1024
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, KVCache, SeqSlice, build_metadata, kernel_attention
from engine.kernels import ops


def kv_bytes_prefill_kernel(meta: AttentionMetadata, kv_heads: int, group: int, dim: int, elem: int) -> int:
    """K and V bytes the prefill kernel reads for every row of the step: each (query block, head) program
    reads its KV head's prefix, then the new keys up to its last query."""
    block_m = 64
    total = 0
    for s in meta.slices:
        for m0 in range(0, s.num_new, block_m):
            keys = s.num_computed + min(s.num_new, m0 + block_m)
            total += kv_heads * group * keys
    return 2 * total * dim * elem


def kv_bytes_split(meta: AttentionMetadata, kv_heads: int, group: int, dim: int, elem: int) -> int:
    """The split step: decode rows read their context once per KV head, the chunks as before."""
    decode = sum(s.num_computed + 1 for s in meta.slices if s.num_new == 1)
    chunks = build_metadata([s for s in meta.slices if s.num_new > 1], meta.block_size)
    return 2 * decode * kv_heads * dim * elem + kv_bytes_prefill_kernel(chunks, kv_heads, group, dim, elem)


def timed(fn: Callable[[], torch.Tensor], repeat: int, device: torch.device) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (and Triton's compile on CUDA)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=16, help="decode sequences in the step")
    parser.add_argument("--context", type=int, default=1024, help="longest decode context (others shorter)")
    parser.add_argument("--chunk", type=int, default=256, help="the prefill chunk's new tokens")
    parser.add_argument("--prefix", type=int, default=512, help="the chunk's cached prefix")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bytes-per-element", type=int, default=2, help="for the count: bf16 on a GPU")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: the references in float32
    block, dim = args.block_size, args.head_dim
    group = args.q_heads // args.kv_heads

    # Decode contexts spread from a quarter of --context up to it; one chunk after a cached prefix
    low, steps = args.context // 4, max(1, args.decode - 1)
    shapes = [(low + (args.context - low) * i // steps - 1, 1) for i in range(args.decode)]
    shapes.insert(len(shapes) // 2, (args.prefix, args.chunk))
    slices, used = [], 0
    for done, new in shapes:
        n = -(-(done + new) // block)
        slices.append(SeqSlice(list(range(used, used + n)), done, new))
        used += n
    meta = build_metadata(slices, block, device)
    cache = KVCache(1, used, block, args.kv_heads, dim, dtype, device)
    g = torch.Generator().manual_seed(0)
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    tokens = meta.num_tokens
    heads = (args.q_heads, args.kv_heads, args.kv_heads)
    q, k, v = (torch.randn(tokens, h, dim, generator=g).to(device, dtype) for h in heads)
    k_cache, v_cache = cache.layer(0)
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = dim**-0.5

    def old_path() -> torch.Tensor:
        return ops.paged_prefill_attention(
            q, k, v, k_cache, v_cache, meta.block_tables, meta.query_start, meta.prefix_lens, block, scale,
            max(meta.query_lens),
        )  # fmt: skip

    def split_path() -> torch.Tensor:
        return kernel_attention(q, k, v, k_cache, v_cache, meta, scale)

    elem = args.bytes_per_element
    old_bytes = kv_bytes_prefill_kernel(meta, args.kv_heads, group, dim, elem)
    new_bytes = kv_bytes_split(meta, args.kv_heads, group, dim, elem)
    decode_ctx = sum(s.num_computed + 1 for s in slices if s.num_new == 1)
    print(
        f"step: {args.decode} decode rows ({decode_ctx} context tokens in all, longest {args.context}), one "
        f"chunk of {args.chunk} after {args.prefix}; {args.q_heads}/{args.kv_heads} heads, dim {dim}"
    )
    print(
        f"K/V bytes read (kernel grids, {elem} B/element): old {old_bytes / 2**20:.1f} MiB, split "
        f"{new_bytes / 2**20:.1f} MiB, ratio {old_bytes / new_bytes:.2f}x"
    )
    path = "Triton kernels" if ops.use_triton(q) else "torch references"
    old_s, old_out = timed(old_path, args.repeat, device)
    new_s, new_out = timed(split_path, args.repeat, device)
    diff = (old_out.float() - new_out.float()).abs().max().item()
    print(
        f"time on {device.type} ({path}, {dtype}): old {old_s * 1e3:.2f} ms, split {new_s * 1e3:.2f} ms, "
        f"ratio {old_s / new_s:.2f}x; max |old - split| {diff:.2e}"
    )


if __name__ == "__main__":
    main()
