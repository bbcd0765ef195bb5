"""bf16 prefill attention on the CPU: the engine's chunked matmuls with shifted scores against torch's SDPA.

    python tests/bench/bench_prefill_attention.py [--tokens 2000] [--heads 12] [--kv-heads 12] [--dim 64]
        [--threads 1] [--rounds 5]

One layer's causal attention over a fresh prompt of ``--tokens`` tokens, in rounds that interleave the paths
(each round times every path once, in a new random order): ``engine/chunked_attention.py`` in bf16, torch's
SDPA in bf16 (what the engine ran before) and in fp32. Prints each path's median and spread over the rounds,
its ratio to bf16 SDPA measured in the same rounds, and its largest difference from the float32 reference on
plain (q and k of deviation 1) and peaked attention (deviation 3: logits of deviation 9, as trained models
reach).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.chunked_attention import chunked_attention

Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # [n, H, D] each -> [n, Hq, D]


def sdpa(dtype: torch.dtype, scale: float) -> Path:
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Head-major and contiguous, as the engine's fastest SDPA call had them.
        q, k, v = (x.to(dtype).transpose(0, 1).contiguous().unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    return run


def chunked(scale: float) -> Path:
    return lambda q, k, v: chunked_attention(q, k, v, scale)


def inputs(args: argparse.Namespace, std: float) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    n, d = args.tokens, args.dim
    q = (torch.randn(n, args.heads, d, generator=g) * std).bfloat16()
    k = (torch.randn(n, args.kv_heads, d, generator=g) * std).bfloat16()
    v = torch.randn(n, args.kv_heads, d, generator=g).bfloat16()
    return q, k, v


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = args.dim**-0.5
    paths: dict[str, Path] = {
        "chunked bf16": chunked(scale),
        "SDPA bf16": sdpa(torch.bfloat16, scale),
        "SDPA fp32": sdpa(torch.float32, scale),
    }
    reference = sdpa(torch.float32, scale)
    errors: dict[str, dict[str, float]] = {name: {} for name in paths}
    for label, std in (("plain", 1.0), ("peaked", 3.0)):
        q, k, v = inputs(args, std)
        expected = reference(q.float(), k.float(), v.float())
        for name, path in paths.items():
            errors[name][label] = float((path(q, k, v).float() - expected).abs().max())  # (also a warm-up)
    q, k, v = inputs(args, 3.0)
    times: dict[str, list[float]] = {name: [] for name in paths}
    order = list(paths)
    for _ in range(args.rounds):
        random.shuffle(order)
        for name in order:
            start = time.perf_counter()
            paths[name](q, k, v)
            times[name].append(time.perf_counter() - start)
    print(
        f"one layer's causal prefill attention: {args.tokens} tokens, {args.heads} query heads /"
        f" {args.kv_heads} KV heads of {args.dim}, {args.threads} thread(s), {args.rounds} interleaved rounds"
    )
    columns = [("median ms", 10), ("min-max ms", 16), ("vs SDPA bf16", 13), ("err plain", 10)]
    columns.append(("err peaked", 11))
    print(f"{'path':14s}" + "".join(f" {title:>{width}s}" for title, width in columns))
    base = statistics.median(times["SDPA bf16"])
    for name, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values) * 1e3:.1f}-{max(values) * 1e3:.1f}"
        ratios = [t / b for t, b in zip(values, times["SDPA bf16"], strict=True)]
        print(
            f"{name:14s} {median * 1e3:10.1f} {spread:>16s} {statistics.median(ratios):12.2f}x"
            f" {errors[name]['plain']:10.4f} {errors[name]['peaked']:11.4f}"
        )
    print(f"(ratios are per round, against that round's bf16 SDPA; its median: {base * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
