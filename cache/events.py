"""KV events (contract 3): what an engine tells the world about the blocks it holds.

A batch is ``{engine, seq, ts, events}``; each event is one of ``stored(block_hashes, parent)``,
``removed(block_hashes)`` or ``cleared()`` — the shape of vLLM's KVEventBatch. On the wire a batch is one
msgpack map, events are arrays tagged by their first element. ``seq`` rises by one per batch: a consumer that
sees a gap resynchronises that engine from a snapshot instead of guessing.
"""

from __future__ import annotations

import array
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


class EventDecodeError(ValueError):
    """A payload that is not a well-formed KV event batch or snapshot."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    engine: str
    seq: int
    ts: float
    events: tuple[KvEvent, ...] = field(default_factory=tuple)
    unknown_events: int = 0  # events of a kind a newer engine added, skipped when decoding (never encoded)

    def encode(self) -> bytes:
        return cast(
            bytes,
            msgpack.packb(
                {
                    "engine": self.engine,
                    "seq": self.seq,
                    "ts": self.ts,
                    "events": [_event_to_wire(e) for e in self.events],
                }
            ),
        )


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """Everything an engine holds, as of batch ``seq``: what a consumer rebuilds from after a gap."""

    engine: str
    seq: int
    block_size: int
    block_hashes: tuple[int, ...]

    def encode(self) -> bytes:
        return cast(
            bytes,
            msgpack.packb(
                {
                    "engine": self.engine,
                    "seq": self.seq,
                    "block_size": self.block_size,
                    "blocks": list(self.block_hashes),
                }
            ),
        )


def _event_to_wire(event: KvEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [STORED, list(event.block_hashes), event.parent]
    if isinstance(event, BlockRemoved):
        return [REMOVED, list(event.block_hashes)]
    return [CLEARED]


def _hashes(value: Any) -> tuple[int, ...]:
    # array("Q") checks in C that every item is an integer in [0, 2**64): a batch of a long prompt carries
    # hundreds of hashes, and a Python loop over them was a measurable share of the gateway's CPU.
    try:
        if not isinstance(value, list):
            raise TypeError
        array.array("Q", value)
    except (TypeError, OverflowError):
        raise EventDecodeError("block hashes must be a list of unsigned 64-bit integers") from None
    return tuple(value)


def _event_from_wire(raw: Any) -> KvEvent | None:
    """The event; None for one of a kind this version does not know (a newer engine's, during a rolling
    upgrade): skipped, so that the batch's known events apply instead of the whole batch failing and the
    consumer going back to a snapshot at every batch. Fields after the known ones are ignored likewise."""
    if not isinstance(raw, list) or not raw:
        raise EventDecodeError(f"an event must be a non-empty array, got {raw!r}")
    kind = raw[0]
    if isinstance(kind, str) and kind and kind not in (STORED, REMOVED, CLEARED):
        return None
    if kind == STORED and len(raw) >= 3:
        parent = raw[2]
        if parent is not None and not (isinstance(parent, int) and 0 <= parent < 2**64):
            raise EventDecodeError("stored.parent must be an unsigned 64-bit integer or nil")
        return BlockStored(_hashes(raw[1]), parent)
    if kind == REMOVED and len(raw) >= 2:
        return BlockRemoved(_hashes(raw[1]))
    if kind == CLEARED:
        return AllCleared()
    raise EventDecodeError(f"unknown or malformed event {raw!r}")


def batch_from_obj(obj: Any) -> KvEventBatch:
    """A batch from an already-unpacked msgpack object (streams unpack many objects in a row)."""
    if not isinstance(obj, dict):
        raise EventDecodeError("a batch must be a map")
    try:
        engine, seq, ts, events = obj["engine"], obj["seq"], obj["ts"], obj["events"]
    except KeyError as exc:
        raise EventDecodeError(f"batch is missing {exc.args[0]!r}") from None
    if not isinstance(engine, str) or not isinstance(seq, int) or seq < 0:
        raise EventDecodeError("batch engine must be a string and seq a non-negative integer")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventDecodeError("batch ts must be a number and events an array")
    decoded = [_event_from_wire(e) for e in events]
    known = tuple(e for e in decoded if e is not None)
    return KvEventBatch(engine, seq, float(ts), known, len(decoded) - len(known))


def decode_batch(payload: bytes) -> KvEventBatch:
    try:
        obj = msgpack.unpackb(payload)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    return batch_from_obj(obj)


def decode_snapshot(payload: bytes) -> KvSnapshot:
    try:
        obj = msgpack.unpackb(payload)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise EventDecodeError("a snapshot must be a map")
    try:
        engine, seq, block_size, blocks = obj["engine"], obj["seq"], obj["block_size"], obj["blocks"]
    except KeyError as exc:
        raise EventDecodeError(f"snapshot is missing {exc.args[0]!r}") from None
    if not isinstance(engine, str) or not isinstance(seq, int) or not isinstance(block_size, int):
        raise EventDecodeError("snapshot engine must be a string, seq and block_size integers")
    return KvSnapshot(engine, seq, block_size, _hashes(blocks))
