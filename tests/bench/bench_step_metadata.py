"""Host time to build one step's attention metadata: the per-step rebuild (``build_metadata``, the block
table from Python lists) against the persistent table (``StepMetadata``: rows written once, extended when
a sequence gains a block). Metadata only, no model; on CPU unless --device says otherwise.

    nice -n 19 .venv/bin/python tests/bench/bench_step_metadata.py --seqs 256 --context 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from engine.attention import SeqSlice, build_metadata
from engine.step_metadata import StepMetadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    block = args.block_size
    per_seq = -(-(args.context + args.steps) // block)
    rng = np.random.default_rng(0)
    pool = rng.permutation(args.seqs * per_seq).tolist()
    owners = [object() for _ in range(args.seqs)]
    full = [pool[i * per_seq : (i + 1) * per_seq] for i in range(args.seqs)]
    # Decode steps: each sequence at ``context`` tokens, one more each step; a block more every 16 steps
    tables = [f[: -(-args.context // block)] for f in full]
    persistent = StepMetadata(block, device, max_num_seqs=args.seqs, max_blocks=per_seq)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    before: list[float] = []
    after: list[float] = []
    for step in range(args.steps):
        done = args.context + step - 1
        for f, t in zip(full, tables, strict=True):
            while len(t) * block < done + 1:
                t.append(f[len(t)])
        ids = np.zeros(args.seqs, dtype=np.int64)
        # the old path: lists copied, table rebuilt, token ids and positions each copied on their own
        start = time.perf_counter()
        meta = build_metadata([SeqSlice(list(t), done, 1) for t in tables], block, device)
        torch.as_tensor(ids.tolist(), dtype=torch.long, device=device)
        torch.as_tensor([done] * args.seqs, dtype=torch.long, device=device)
        sync()
        before.append(time.perf_counter() - start)
        start = time.perf_counter()
        new, _, _ = persistent.build([(o, t, done, 1) for o, t in zip(owners, tables, strict=True)], ids)
        sync()
        after.append(time.perf_counter() - start)
        if step == 0:
            assert torch.equal(new.block_tables.cpu(), meta.block_tables.cpu())
            assert torch.equal(new.slot_mapping.cpu(), meta.slot_mapping.cpu())
    b, a = statistics.median(before[1:]), statistics.median(after[1:])  # the first persistent step writes all
    print(f"{args.seqs} sequences x {args.context} context, block {block}, {device.type}, {args.steps} steps")
    print(f"before (rebuild): {b * 1e3:.3f} ms   after (persistent): {a * 1e3:.3f} ms   ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
