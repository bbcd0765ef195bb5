"""Tensor and pipeline parallelism on CPU worker processes, against one process in the same run.

    python tests/bench/bench_parallel.py [--model DIR] [--prompts 8] [--prompt-len 256] [--new-tokens 16]
                                         [--rounds 1]

For each layout (one process with all threads and with one; tp=2; pp=2 with micro-batches; pp=2 as one
micro-batch, i.e. no overlap; tp=2 x pp=2) it runs the same prompts to completion with greedy decoding and
prints the wall time of the prefill-heavy first round, the decode tokens per second, and each as a ratio to
one process with all threads (medians over the rounds; each round measures every layout once, in turn).
It also checks that every layout produced the one-process tokens. Each rank runs cpu_count / ranks torch
threads: on a CPU machine the ranks share the cores one process would use, so the ratios show the cost of
the communication and the gain of overlapping stages, not the speed-up of adding GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.parallel.executor import ParallelExecutor
from engine.sequence import SamplingParams

# name, tp, pp, micro-batches (None: one per stage), torch threads of one process (None: all)
LAYOUTS = [("one process", 1, 1, None, None), ("one process, 1 thread", 1, 1, None, 1),
           ("tp=2", 2, 1, None, None), ("pp=2", 1, 2, None, None), ("pp=2, one micro-batch", 1, 2, 1, None),
           ("tp=2 x pp=2", 2, 2, None, None)]  # fmt: skip


def measure(
    model: str, tp: int, pp: int, micro: int | None, threads: int | None, args: argparse.Namespace
) -> tuple[float, float, list]:
    all_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    engine = LLMEngine(
        EngineConfig(
            model, device="cpu", num_kv_blocks=2048, tensor_parallel_size=tp, pipeline_parallel_size=pp
        )
    )
    try:
        if micro is not None:
            assert isinstance(engine.runner, ParallelExecutor)
            engine.runner.num_micro_batches = micro
        vocab = engine.model_config.vocab_size
        prompts = [
            [(31 * i + 7 * j + 11) % (vocab - 3) + 3 for j in range(args.prompt_len)]
            for i in range(args.prompts)
        ]
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, temperature=0.0))  # warm up
        first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        engine.generate(prompts, first)
        prefill_s = time.perf_counter() - started
        # Decode: the prompts are cached now, so this round is (nearly) all decode steps.
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        tokens = engine.generate(prompts, params)
        decode_tps = args.prompts * args.new_tokens / (time.perf_counter() - started)
        return prefill_s, decode_tps, tokens
    finally:
        engine.close()
        torch.set_num_threads(all_threads)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="model directory (default: a random 'small' preset, ~88M parameters)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from engine.make_model import make_model

        model = str(make_model(Path(tempfile.mkdtemp()) / "small", "small", seed=0))
    runs: dict[str, list[tuple[float, float, list]]] = {name: [] for name, *_ in LAYOUTS}
    for round_ in range(args.rounds):
        for name, tp, pp, micro, threads in LAYOUTS:
            runs[name].append(measure(model, tp, pp, micro, threads, args))
            print(f"  round {round_ + 1}: measured {name}", file=sys.stderr, flush=True)
    rows = [
        (
            name,
            statistics.median(r[0] for r in results),
            statistics.median(r[1] for r in results),
            results[0][2] if all(r[2] == results[0][2] for r in results) else None,
        )
        for name, results in runs.items()
    ]
    base_prefill, base_decode, base_tokens = rows[0][1], rows[0][2], rows[0][3]
    print(
        f"{args.prompts} prompts of {args.prompt_len} tokens, {args.new_tokens} new tokens each, CPU, "
        f"{torch.get_num_threads()} threads, median of {args.rounds} round(s)"
    )
    print(f"{'layout':24} {'prefill s':>10} {'x one':>7} {'decode tok/s':>13} {'x one':>7}  same tokens")
    for name, prefill_s, decode_tps, tokens in rows:
        print(
            f"{name:24} {prefill_s:10.3f} {base_prefill / prefill_s:7.2f} {decode_tps:13.1f} "
            f"{decode_tps / base_decode:7.2f}  {tokens == base_tokens}"
        )
    by_name = {row[0]: row for row in rows}
    overlap = by_name["pp=2, one micro-batch"][1] / by_name["pp=2"][1]
    print(f"pp=2 prefill, micro-batches vs one batch: {overlap:.2f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
