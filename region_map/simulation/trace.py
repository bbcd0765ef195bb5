"""Mooncake-format request traces: ``{"timestamp": ms, "input_length", "output_length", "hash_ids"}`` a line.

``hash_ids`` are chained ids of 512-token blocks: an equal id at position i means an equal prefix up to
block i. Timestamps are rounded to buckets of a few seconds; requests of one bucket are spread evenly over
it so they do not all arrive in the same instant.

The trace carries no session ids. The key a client would send as ``x-session-affinity`` is derived from the
conversation's first non-shared block: block 0 is everyone's system prompt, so a conversation is named by
its ``hash_ids[1]`` (every turn of a chat resends its history, so all its turns share that block, and no two
conversations do), or by ``hash_ids[0]`` for a one-block request.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that is not a Mooncake request; the message gives file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]  # chained block ids; the last block may be partial
    conversation: int  # the x-session-affinity a client would send (see the module docstring)


def conversation_key(hash_ids: list[int]) -> int:
    return hash_ids[1] if len(hash_ids) > 1 else hash_ids[0]


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    raw: list[tuple[int, int, int, list[int]]] = []
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open  # the trace ships gzipped in tests/data
    with opener(p, "rt") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ts, inputs, outputs = (
                    int(row["timestamp"]),
                    int(row["input_length"]),
                    int(row["output_length"]),
                )
                item = (ts, inputs, outputs, row["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{p}:{number}: not a Mooncake request ({exc})") from None
            if not isinstance(item[3], list) or not item[3] or not all(isinstance(h, int) for h in item[3]):
                raise TraceError(f"{p}:{number}: hash_ids must be a non-empty list of integers")
            if inputs < 1 or outputs < 0:
                message = "input_length must be at least 1 and output_length at least 0"
                raise TraceError(f"{p}:{number}: {message}")
            raw.append(item)
            if limit is not None and len(raw) >= limit:
                break
    if not raw:  # (its figures would all be 0: a mistaken path or an empty file, not a workload)
        raise TraceError(f"{p} holds no request")
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, (ts, *_rest) in enumerate(raw):
        buckets[ts].append(i)
    stamps = sorted(buckets)
    width = {t: ((stamps[k + 1] - t) if k + 1 < len(stamps) else 1000) / 1000.0 for k, t in enumerate(stamps)}
    requests = []
    for ts in stamps:
        members = buckets[ts]
        for j, i in enumerate(members):
            _, input_tokens, output_tokens, hash_ids = raw[i]
            arrival = ts / 1000.0 + width[ts] * j / len(members)
            blocks = tuple(hash_ids)
            requests.append(
                TraceRequest(arrival, input_tokens, output_tokens, blocks, conversation_key(hash_ids))
            )
    return requests
