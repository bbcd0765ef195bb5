"""KV events of other engines (vLLM, SGLang), decoded from their ZMQ payloads into typed records.

A payload is msgspec's msgpack of ``EventBatch``, an array ``[ts, events, data_parallel_rank]`` (SGLang
before ``attn_dp_rank``: ``[ts, events]``). Each event is either a map whose ``"type"`` key names it
(vLLM >= ~0.26) or a tagged positional array ``[tag, field, ...]`` (older vLLM, SGLang). Fields left at
their default may be omitted: in a map any of them, in an array the trailing ones. Fields this module does
not know (vLLM keeps adding trailing ones) are ignored, and so are events of a type it does not know: they
are listed in ``ForeignBatch.unknown_events`` and the batch's known events still apply.

Engine block hashes are opaque ids here: vLLM sends uint64 (older versions raw digest bytes), SGLang a
signed int64. ``cache.foreign_chain`` turns these records into kvgate's own (contract 1) hashes.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from cache.events import EventDecodeError

EngineHash = int | bytes

STORED_TAG = "BlockStored"
REMOVED_TAG = "BlockRemoved"
CLEARED_TAG = "AllBlocksCleared"

# BlockStored's fields in vLLM's order (vllm/distributed/kv_events.py). SGLang shares the first six; its
# BlockStoredWithMetadata puts a ``metadata`` map (``{"cache_salt": ...}``) where vLLM has ``lora_name``.
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_TAG_KEPT = 64  # characters of an unknown type tag kept for the log
_MIN_STORED = 4  # hashes, parent, tokens, block size: nothing can be done with less
_I64_MIN = -(2**63)
_U64_END = 2**64


@dataclass(frozen=True, slots=True)
class ForeignStored:
    """Blocks an engine now holds: ``block_hashes[i]`` holds ``token_ids[i*block_size:(i+1)*block_size]``,
    chained on ``parent`` (None: the first block of a prompt). ``token_ids`` is None where the engine sent
    something other than plain token ids (SGLang's bigram pages)."""

    block_hashes: tuple[EngineHash, ...]
    parent: EngineHash | None
    token_ids: Sequence[int] | None
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    cache_salt: str | None = None  # SGLang's metadata.cache_salt (vLLM's salt is in extra_keys)


@dataclass(frozen=True, slots=True)
class ForeignRemoved:
    """Blocks an engine evicted (vLLM: one event per block, tail blocks first)."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class ForeignCleared:
    """The engine's prefix cache was reset."""


ForeignEvent = ForeignStored | ForeignRemoved | ForeignCleared


@dataclass(frozen=True, slots=True)
class ForeignBatch:
    ts: float
    events: tuple[ForeignEvent, ...]
    data_parallel_rank: int | None = None
    unknown_events: tuple[str, ...] = ()  # the type tags of the events skipped, in batch order


def decode_foreign_batch(payload: bytes) -> ForeignBatch:
    """One vLLM/SGLang ``EventBatch`` payload; raises ``EventDecodeError`` on anything malformed."""
    try:
        obj = msgpack.unpackb(payload, strict_map_key=False)
    # TypeError: a map key msgpack can encode but a dict cannot hold (an array or a map). It must read as
    # an unreadable batch like any other: escaping from here, it would stop the rank's follower, and the
    # replay would hand the same batch back at every retry.
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    return foreign_batch_from_obj(obj)


def foreign_batch_from_obj(obj: Any) -> ForeignBatch:
    """A batch from an already-unpacked msgpack object."""
    # Fields past the rank are ones a newer engine added to its EventBatch (msgspec appends them to an
    # array_like struct): ignored, as those of events are. Refusing them would lose every batch.
    if isinstance(obj, list) and len(obj) >= 2:
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) >= 3 else None
    elif isinstance(obj, dict) and "ts" in obj and "events" in obj:  # EventBatch without array_like
        ts, events = obj["ts"], obj["events"]
        rank = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise EventDecodeError("an event batch must be [ts, events, data_parallel_rank, ...] or [ts, events]")
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventDecodeError(f"batch ts must be a number, got {ts!r}")
    if not isinstance(events, list):
        raise EventDecodeError("batch events must be an array")
    if rank is not None and not _is_int(rank):
        raise EventDecodeError(f"data_parallel_rank must be an integer or nil, got {rank!r}")
    known: list[ForeignEvent] = []
    unknown: list[str] = []
    for raw in events:
        event = _event(raw)
        if isinstance(event, str):
            unknown.append(event)
        else:
            known.append(event)
    return ForeignBatch(float(ts), tuple(known), rank, tuple(unknown))


def _event(raw: Any) -> ForeignEvent | str:
    """The event, or the type tag of an event of a type this module does not know."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        values = raw
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        values = None
    else:
        raise EventDecodeError(f"an event must be a map or a non-empty array, got {raw!r}")
    if tag == STORED_TAG:
        return _stored(raw, values)
    if tag == REMOVED_TAG:
        return _removed(raw, values)
    if tag == CLEARED_TAG:
        return ForeignCleared()
    if not isinstance(tag, str) or not tag:
        raise EventDecodeError(f"an event's type must be a non-empty string, got {tag!r}")
    # A type added by a newer engine release: skipped and counted, as msgpack consumers do. Treating it
    # as an unreadable batch would make the follower forget the rank at every batch that carries one, so
    # routing would never see that engine's cache again; the three types above are the ones that say
    # what the cache holds, and stay applied.
    return tag[:_TAG_KEPT]


def _fields(raw: list[Any], names: Sequence[str]) -> dict[str, Any]:
    # Fields past ``names`` (vLLM's kv_cache_spec_*, locality, ownership, session_id) change nothing here.
    return dict(zip(names, raw[1:], strict=False))


def _stored(raw: Any, values: dict[str, Any] | None) -> ForeignStored:
    if values is None:
        if len(raw) - 1 < _MIN_STORED:
            raise EventDecodeError(f"BlockStored needs at least {_MIN_STORED} fields, got {len(raw) - 1}")
        values = _fields(raw, _STORED_FIELDS)
        if isinstance(values.get("lora_name"), dict):  # SGLang's BlockStoredWithMetadata
            values["metadata"] = values.pop("lora_name")
    for key in ("block_hashes", "token_ids", "block_size"):
        if key not in values:
            raise EventDecodeError(f"BlockStored is missing {key!r}")
    hashes = _hashes(values["block_hashes"], STORED_TAG)
    parent = values.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise EventDecodeError(f"BlockStored.parent_block_hash must be a 64-bit id, bytes or nil: {parent!r}")
    block_size = values["block_size"]
    if not _is_int(block_size) or block_size < 0:
        raise EventDecodeError(f"BlockStored.block_size must be a non-negative integer: {block_size!r}")
    metadata = values.get("metadata")
    salt = None
    if metadata is not None:
        salt = metadata.get("cache_salt") if isinstance(metadata, dict) else None
        if not isinstance(salt, str | None):
            raise EventDecodeError(f"BlockStored metadata.cache_salt must be a string: {salt!r}")
    return ForeignStored(
        block_hashes=hashes,
        parent=parent,
        token_ids=_token_ids(values["token_ids"]),
        block_size=block_size,
        lora_id=_optional_int(values.get("lora_id"), "lora_id"),
        medium=_optional_str(values.get("medium"), "medium"),
        lora_name=_optional_str(values.get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(values.get("extra_keys")),
        group_idx=_optional_int(values.get("group_idx"), "group_idx"),
        cache_salt=salt,
    )


def _removed(raw: Any, values: dict[str, Any] | None) -> ForeignRemoved:
    if values is None:
        if len(raw) < 2:
            raise EventDecodeError("BlockRemoved needs its block_hashes")
        values = _fields(raw, _REMOVED_FIELDS)
    if "block_hashes" not in values:
        raise EventDecodeError("BlockRemoved is missing 'block_hashes'")
    return ForeignRemoved(
        block_hashes=_hashes(values["block_hashes"], REMOVED_TAG),
        medium=_optional_str(values.get("medium"), "medium"),
        group_idx=_optional_int(values.get("group_idx"), "group_idx"),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hash(value: Any) -> bool:
    if isinstance(value, bytes):
        return len(value) > 0
    return _is_int(value) and _I64_MIN <= value < _U64_END


def _hashes(value: Any, tag: str) -> tuple[EngineHash, ...]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{tag}.block_hashes must be an array")
    try:
        # The common case (vLLM's uint64) checked in C: a long prompt's event carries hundreds of hashes.
        array.array("Q", value)
    except (TypeError, OverflowError):
        if not all(_is_hash(h) for h in value):
            raise EventDecodeError(
                f"{tag}.block_hashes must hold 64-bit integer ids or bytes: {value[:4]!r}..."
            ) from None
    return tuple(value)


def _token_ids(value: Any) -> Sequence[int] | None:
    if not isinstance(value, list):
        raise EventDecodeError("BlockStored.token_ids must be an array")
    try:
        array.array("I", value)  # 32-bit unsigned, checked in C
    except (TypeError, OverflowError):
        if value and all(isinstance(t, list) for t in value):
            return None  # SGLang's bigram pages (EAGLE): pairs, not token ids; never indexed
        raise EventDecodeError("BlockStored.token_ids must hold token ids in [0, 2**32)") from None
    return value


def _extra_keys(value: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(k is None or isinstance(k, list) for k in value):
        raise EventDecodeError("BlockStored.extra_keys must be an array of arrays or nils")
    return tuple(None if k is None else tuple(k) for k in value)


def _optional_int(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise EventDecodeError(f"{name} must be an integer or nil, got {value!r}")
    return int(value)


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise EventDecodeError(f"{name} must be a string or nil, got {value!r}")
    return value
