"""What an engine pays to read the token ids the gateway sends (``prompt_token_ids``): JSON to uint32.

    python tests/bench/bench_token_ids.py [--tokens 35000] [--rounds 30]

Times ``engine.openai_api.parse_request`` on a completion body carrying ``--tokens`` ids packed
(``prompt_token_ids_hex``, what the gateway sends engines that report ``token_ids_hex``) against the same
ids as JSON numbers (``prompt_token_ids``), and for the latter its parts: ``orjson.loads`` alone, and the
ids' conversion as the engine made it before (``np.asarray`` on the list, then range checks) against now
(``array('I')``, checked in C).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from cache.tokens import ByteTokenizer, pack_token_ids, uint32_array
from engine.openai_api import parse_request


def best_ms(fn: Callable[[], Any], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def numpy_ids(value: list[int]) -> np.ndarray:
    """The conversion before: numpy infers a dtype from the Python ints, then the range is checked."""
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= 2**32:
        raise ValueError("bad ids")
    return arr.astype(np.uint32, copy=False)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=35_000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    ids = np.random.default_rng(0).integers(0, 150_000, args.tokens, dtype=np.uint32)
    body = orjson.dumps(
        {"model": "m", "prompt": "x", "prompt_token_ids": ids}, option=orjson.OPT_SERIALIZE_NUMPY
    )
    values = orjson.loads(body)["prompt_token_ids"]
    packed_body = orjson.dumps({"model": "m", "prompt": "x", "prompt_token_ids_hex": pack_token_ids(ids)})
    tok = ByteTokenizer()
    parse = best_ms(lambda: parse_request(body, "completion", served_model="m", tokenizer=tok), args.rounds)
    packed = best_ms(
        lambda: parse_request(packed_body, "completion", served_model="m", tokenizer=tok), args.rounds
    )
    loads = best_ms(lambda: orjson.loads(body), args.rounds)
    before = best_ms(lambda: numpy_ids(values), args.rounds)
    now = best_ms(lambda: uint32_array(values), args.rounds)
    assert (numpy_ids(values) == uint32_array(values)).all()
    print(f"{args.tokens} token ids, best of {args.rounds}: parse_request packed {packed:.2f} ms,", end=" ")
    print(f"as JSON numbers {parse:.2f} ms -> ratio {packed / parse:.3f}")
    print(f"  JSON numbers: orjson.loads alone {loads:.2f} ms")
    print(f"  ids to uint32: array('I') {now:.2f} ms, np.asarray before {before:.2f} ms", end=" ")
    print(f"-> ratio {now / before:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
