"""How long the gateway holds its event loop to bill a large whole answer: an embeddings answer of
``--inputs`` vectors of ``--dims`` floats (vLLM's shape), its usage read and the cost added (a) by parsing the
answer whole and writing it out again (what every answer got before gateway.http.answer_usage), and (b) at
its end (gateway.http.answer_usage.tail_usage), written out as views of the engine's bytes. Interleaved
rounds, medians, and (b)/(a) in the same run.

    python tests/bench/bench_answer_usage.py [--inputs 2048] [--dims 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import orjson

from gateway.http.answer_usage import tail_usage

COST = {"cost": 0.000123}


def answer(inputs: int, dims: int) -> bytes:
    vectors = np.random.default_rng(0).standard_normal((inputs, dims)).astype(np.float32)
    data = [{"index": i, "object": "embedding", "embedding": v.tolist()} for i, v in enumerate(vectors)]
    usage = {"prompt_tokens": inputs * 10, "total_tokens": inputs * 10}
    body = {"id": "embd-1", "object": "list", "created": 1, "model": "m", "data": data, "usage": usage}
    return orjson.dumps(body)


def whole(body: bytes) -> bytes:
    parsed = orjson.loads(body)
    parsed["usage"] = {**parsed["usage"], **COST}
    return orjson.dumps(parsed)


def at_end(body: bytes) -> list[bytes | memoryview]:
    """The parts the gateway writes (views of the engine's bytes around the new usage): nothing copied."""
    tail = tail_usage(body)
    assert tail is not None
    return tail.replaced({**tail.usage, **COST})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--inputs", type=int, default=2048)
    parser.add_argument("--dims", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    body = answer(args.inputs, args.dims)
    assert orjson.loads(b"".join(at_end(body))) == orjson.loads(whole(body))
    times: dict[str, list[float]] = {"whole": [], "at_end": []}
    for _ in range(args.rounds):
        for name, fn in (("whole", whole), ("at_end", at_end)):
            start = time.perf_counter()
            fn(body)
            times[name].append(time.perf_counter() - start)
    a, b = statistics.median(times["whole"]), statistics.median(times["at_end"])
    print(f"answer: {len(body) / 1e6:.1f} MB ({args.inputs} inputs x {args.dims} floats)")
    for name in times:
        spread = f"{min(times[name]) * 1e3:.1f}-{max(times[name]) * 1e3:.1f}"
        print(f"  {name:7s} median {statistics.median(times[name]) * 1e3:8.1f} ms  (rounds {spread} ms)")
    print(f"  at_end / whole: {b / a:.4f}")


if __name__ == "__main__":
    main()
