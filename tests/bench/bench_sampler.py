"""The batched sampler's step time per mode against greedy's, measured in the same run (and the old host
sampler's top-p, which sorted each row in a Python loop, for reference).

    python tests/bench/bench_sampler.py [--batch 32] [--vocab 32000] [--device cpu] [--threads N]
        [--iters 20] [--rounds 5] [--model DIR [--steps 16]] [--json]

Sampler step: ``Sampler.sample`` on [batch, vocab] float32 logits shaped like a language model's (a Zipf
law over a random permutation, plus noise), the call the engine makes each step, host transfer included.
With ``--model`` also the engine's decode step (model + sampler) at that batch, greedy vs top-p.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.sampler import Sampler
from engine.sequence import SamplingParams, Sequence

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_p 0.95 + top_k 50": SamplingParams(temperature=0.7, top_p=0.95, top_k=50),
    "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    "top_p 0.9 + penalties": SamplingParams(
        temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
    ),
}


def lm_like_logits(batch: int, vocab: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(vocab, generator=g) for _ in range(batch)]) + 1
    logits = -1.2 * ranks.double().log() + 0.5 * torch.randn(batch, vocab, generator=g, dtype=torch.float64)
    return (logits * 3).float().to(device)


def timed(fn: Callable[[], object], iters: int, setup: Callable[[], object] = lambda: None) -> float:
    """Median seconds per call of ``fn`` (``setup`` runs before each, untimed), after a warm-up call."""
    setup()
    fn()
    times = []
    for _ in range(iters):
        setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sampler_step(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[Callable[[], object], Callable[[], object]]:
    """(setup, step): the step samples from a fresh copy of ``logits`` that the setup makes (the sampler
    consumes its logits, as the engine hands it new ones each step)."""
    batch, vocab = logits.shape
    sampler = Sampler(vocab)
    seqs = [Sequence(f"s{i}", [1 + i, 2 + i, 3 + i], params, 0) for i in range(batch)]
    work = torch.empty_like(logits)

    def setup() -> None:
        work.copy_(logits)
        if logits.device.type == "cuda":
            torch.cuda.synchronize()

    def step() -> object:
        out = sampler.sample(work, seqs)  # ends with the ids on the host: the device is done
        return out

    return setup, step


def old_host_top_p(logits: torch.Tensor, top_p: float) -> Callable[[], object]:
    """The sampler this one replaced: logits copied to the host, one row at a time, a full sort per row."""
    generators = [torch.Generator().manual_seed(i) for i in range(logits.shape[0])]

    def step() -> list[int]:
        out = []
        for row, g in zip(logits.float().cpu(), generators, strict=True):
            probs = torch.softmax(row, dim=-1)
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
            out.append(int(torch.multinomial(probs, 1, generator=g)))
        return out

    return step


def engine_steps(model: str, batch: int, modes: dict[str, SamplingParams], steps: int) -> dict[str, float]:
    """Median decode-step seconds of the engine at ``batch`` running sequences, per mode: one engine per
    mode, stepped in turn, so that whatever else loads the machine falls on every mode alike."""
    from engine.llm_engine import EngineConfig, LLMEngine

    engines = {}
    for name, params in modes.items():
        engine = LLMEngine(EngineConfig(model, device="cpu", max_num_seqs=batch, num_kv_blocks=64 * batch))
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            prompt = [(7 * i + 13 * j + 3) % vocab for j in range(16)]
            engine.add_request(f"r{i}", prompt, replace(params, max_tokens=steps + 1, ignore_eos=True))
        engine.step()  # the prefill (and the first token)
        engines[name] = engine
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(steps):
        for name, engine in engines.items():
            start = time.perf_counter()
            engine.step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over all modes; the best round counts")
    parser.add_argument("--model", help="also time the engine's decode step on this model (CPU)")
    parser.add_argument("--steps", type=int, default=16, help="engine decode steps per mode")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logits = lm_like_logits(args.batch, args.vocab, args.device)
    steps = {name: sampler_step(logits, params) for name, params in MODES.items()}
    # Modes take turns, round after round, and each keeps its best round: load from elsewhere on the
    # machine comes and goes, and should not land on one mode only.
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, (setup, step) in steps.items():
            rounds[name].append(timed(step, args.iters, setup))
    results = {name: min(t) for name, t in rounds.items()}
    results["old host sampler, top_p 0.9"] = timed(old_host_top_p(logits, 0.9), 3)
    greedy = results["greedy"]
    report: dict[str, object] = {
        "batch": args.batch,
        "vocab": args.vocab,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "sampler_ms": {k: round(v * 1e3, 3) for k, v in results.items()},
        "sampler_ratio_to_greedy": {k: round(v / greedy, 2) for k, v in results.items()},
    }
    if args.model:
        engine = engine_steps(
            args.model, args.batch, {k: MODES[k] for k in ("greedy", "top_p 0.9")}, args.steps
        )
        report["engine_step_ms"] = {k: round(v * 1e3, 3) for k, v in engine.items()}
        report["engine_step_ratio_top_p_to_greedy"] = round(engine["top_p 0.9"] / engine["greedy"], 3)
    if args.json:
        print(json.dumps(report))
        return
    print(
        f"batch {args.batch}, vocab {args.vocab}, {args.device}, {torch.get_num_threads()} threads: "
        f"sampler step, best of {args.rounds} rounds of median of {args.iters}"
    )
    for name, seconds in results.items():
        print(f"  {name:28s} {seconds * 1e3:8.3f} ms   {seconds / greedy:6.2f} x greedy")
    if args.model:
        print(
            f"engine decode step (model + sampler), median of {args.steps}: {report['engine_step_ms']}, "
            f"top-p / greedy = {report['engine_step_ratio_top_p_to_greedy']}"
        )


if __name__ == "__main__":
    main()
