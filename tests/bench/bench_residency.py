"""The in-process residency index under the churn of KV events: what storing, evicting and looking up a
long prompt's blocks costs, at the size a busy fleet keeps.

    python tests/bench/bench_residency.py [--engines 4] [--blocks 875] [--capacity 64000] [--steps 400]

Every engine holds ``--capacity`` blocks (random 64-bit hashes, as chain hashes look); each step, one engine
stores a new prompt of ``--blocks`` blocks and evicts its oldest one (the events of one prefill), then the
gateway looks up a prompt that the engine holds whole and that every engine shares the first block of (a
system prompt). Last, the lookup's worst case: every engine holds the same long prefix of the prompt.
Printed: microseconds per step for the events and per lookup, and for scale the same number of C-level
set insertions and removals (``set.update`` / ``set.difference_update``) measured in the same run, as a
ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from cache.residency_memory import MemoryResidencyIndex


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=875, help="blocks per prompt (14k tokens of 16)")
    parser.add_argument("--capacity", type=int, default=64_000, help="blocks each engine holds")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    rng = random.Random(1)
    engines = [f"bench/e{i}" for i in range(args.engines)]
    system = rng.getrandbits(64)

    def prompt() -> list[int]:
        return [system] + [rng.getrandbits(64) for _ in range(args.blocks - 1)]

    index = MemoryResidencyIndex()
    plain: dict[str, set[int]] = {e: set() for e in engines}
    held: dict[str, list[list[int]]] = {e: [] for e in engines}
    for e in engines:
        for _ in range(args.capacity // args.blocks):
            p = prompt()
            held[e].append(p)
            index.add_now(e, p)
            plain[e].update(p)
    steps = [(engines[i % len(engines)], prompt()) for i in range(args.steps)]
    queues = {e: list(v) for e, v in held.items()}
    start = time.perf_counter()
    for e, p in steps:
        index.add_now(e, p)
        queues[e].append(p)
        old = queues[e].pop(0)
        index.remove_now(e, old[1:])  # the shared first block stays, as a system prompt's would
    events_s = (time.perf_counter() - start) / args.steps
    queues = {e: list(v) for e, v in held.items()}
    start = time.perf_counter()
    for e, p in steps:
        plain[e].update(p)
        queues[e].append(p)
        plain[e].difference_update(queues[e].pop(0)[1:])
    sets_s = (time.perf_counter() - start) / args.steps
    lookups = [queues[e][-1] for e, _ in steps[-50:]]
    start = time.perf_counter()
    for _ in range(4):
        for p in lookups:
            found = index.lookup(p)
            assert max(found.values()) == len(p) and len(found) == len(engines), found
    lookup_s = (time.perf_counter() - start) / (4 * len(lookups))
    # Every engine holding the same long prefix (a document everyone asks about): the lookup's worst case.
    shared_index = MemoryResidencyIndex()
    document = prompt() * 4
    for e in engines:
        shared_index.add_now(e, [*document, *prompt()[1:]])
    asked = [*document, *prompt()[1:]]
    start = time.perf_counter()
    for _ in range(20):
        assert set(shared_index.lookup(asked).values()) == {len(document)}
    shared_s = (time.perf_counter() - start) / 20
    n = args.blocks
    print(f"{args.engines} engines x {args.capacity} blocks, prompts of {n} blocks, {args.steps} steps:")
    print(f"  events (store {n} + evict {n - 1}): {events_s * 1e6:.0f} us per step; plain sets "
          f"{sets_s * 1e6:.0f} us -> ratio {events_s / sets_s:.2f}")  # fmt: skip
    print(f"  lookup of a {n}-block prompt: {lookup_s * 1e6:.0f} us")
    print(f"  lookup of a prompt whose {len(document)}-block prefix all {args.engines} engines hold: "
          f"{shared_s * 1e6:.0f} us")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
