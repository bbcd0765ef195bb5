"""What the SSE usage tap pays for one large event that arrives in many small reads.

    python -m tests.bench.bench_sse_tap [--read-kb 4] [--rounds 3]

Feeds ``gateway.http.sse.SseUsageTap`` one chat event of 1 MB and one of 4 MB (a token of that size: an
engine echoing a prompt, a tool call's arguments), each cut into ``--read-kb`` reads as the socket hands them
over, and prints the best time of each. The baseline, measured in the same run, is the same event fed in one
read. A tap that searches each read's new bytes only costs about 4x as much for 4 MB as for 1 MB; one that
searches the whole buffered event again on every read costs about 16x (quadratic). ``scanned`` is the bytes
the tap searched for an event's end (the tap's own counter), against the event's size.
"""

from __future__ import annotations

import argparse
import sys
import time

from gateway.http.sse import SseUsageTap

MB = 1 << 20


def event_of(size: int) -> bytes:
    head, tail = b'data: {"choices":[{"index":0,"delta":{"content":"', b'"}}]}\n\n'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def feed_ms(event: bytes, read: int, rounds: int) -> tuple[float, int]:
    """Best time of ``rounds`` to feed ``event`` in reads of ``read`` bytes, and the bytes the tap scanned."""
    reads = [event[i : i + read] for i in range(0, len(event), read)]
    best, scanned = float("inf"), 0
    for _ in range(rounds):
        tap = SseUsageTap(forward_usage_event=False)
        start = time.perf_counter()
        out = b"".join([tap.feed(data) for data in reads])
        best = min(best, time.perf_counter() - start)
        assert out == event and tap.events == 1
        scanned = getattr(tap, "scanned", -1)  # -1: a tap without the counter (before it was added)
    return best * 1e3, scanned


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--read-kb", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    read = args.read_kb * 1024
    times = {}
    for size in (1 * MB, 4 * MB):
        event = event_of(size)
        whole, _ = feed_ms(event, len(event), args.rounds)
        split, scanned = feed_ms(event, read, args.rounds)
        times[size] = split
        print(f"{size // MB} MB event in {args.read_kb} KB reads: {split:.1f} ms,", end=" ")
        print(f"in one read {whole:.2f} ms", end="")
        searched = f"{scanned / size:.2f}x the event" if scanned >= 0 else "not counted"
        print(f" -> ratio {split / whole:.1f}; scanned {searched}")
    print(f"4 MB / 1 MB time ratio: {times[4 * MB] / times[1 * MB]:.1f} (linear ~4, quadratic ~16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
