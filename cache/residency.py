"""The residency index: which engine holds which KV blocks, behind one Protocol with two backends.

Exact entries come from engines' KV events and live until removed; approximate entries are a gateway's own
record of where it sent a prefix (for engines that publish no events) and expire after a TTL.

In production, routing reads only the in-process backend (``MemoryResidencyIndex.lookup``, synchronous);
the Redis backend is a bounded, expiring mirror that gateways write and read back with ``holdings`` (a warm
start, a resync after losing the updates channel). Both keep the whole Protocol, ``longest_prefix``
included, so that one contract suite pins one meaning of every operation for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEventBatch


@dataclass(frozen=True, slots=True)
class EngineHoldings:
    """One engine's entries as of event ``seq`` (None: no batch applied yet)."""

    seq: int | None
    exact: frozenset[int] = field(default_factory=frozenset)
    approximate: dict[int, float] = field(default_factory=dict)  # hash -> seconds left to live


@runtime_checkable
class ResidencyIndex(Protocol):
    """Where KV blocks live. All methods are safe to call concurrently from one event loop.

    Hashes are the chained block hashes of ``cache.hashing``; because each hash names its whole prefix, an
    engine holds a prefix of ``n`` blocks exactly when it holds each of the first ``n`` hashes.
    """

    async def add(self, engine: str, hashes: Sequence[int], *, ttl_s: float | None = None) -> None:
        """Record that ``engine`` holds ``hashes``. With ``ttl_s`` the entries are approximate and expire;
        an approximate add never downgrades an exact entry."""
        ...

    async def remove(self, engine: str, hashes: Sequence[int]) -> None:
        """Forget ``hashes`` on ``engine`` (exact or approximate); unknown hashes are ignored."""
        ...

    async def clear(self, engine: str) -> None:
        """Forget everything ``engine`` holds; its event ``seq`` is kept."""
        ...

    async def apply(self, engine: str, batch: KvEventBatch) -> bool:
        """Apply an event batch atomically unless ``batch.seq`` is not newer than the last one applied for
        ``engine``. Returns whether it was applied: several consumers may deliver the same batch."""
        ...

    async def replace(self, engine: str, hashes: Sequence[int], seq: int) -> None:
        """Atomically make ``hashes`` the engine's exact entries as of ``seq`` (a snapshot resync).
        Approximate entries are dropped too: the snapshot is the truth."""
        ...

    async def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """For every engine holding at least ``hashes[0]``, how many leading blocks of ``hashes`` it holds.
        Engines holding none are absent. Expired approximate entries count as absent. Does not modify.
        (The contract's read; the gateway routes with the in-process view's synchronous ``lookup``.)"""
        ...

    async def holdings(self, engine: str) -> EngineHoldings:
        """Everything recorded for ``engine``: what a new in-process view starts from."""
        ...

    async def engines(self) -> list[str]:
        """Every engine the index has an entry or a sequence number for."""
        ...

    async def sweep(self) -> int:
        """Delete expired approximate entries; returns how many. Lookups already ignore them. (In Redis the
        block keys expire by themselves; this clears the per-engine sets, one gateway at a time.)"""
        ...


def batch_ops(batch: KvEventBatch) -> list[tuple[str, tuple[int, ...]]]:
    """A batch as ordered (op, hashes) steps, op being ``add``, ``remove`` or ``clear``."""
    ops: list[tuple[str, tuple[int, ...]]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            ops.append(("add", event.block_hashes))
        elif isinstance(event, BlockRemoved):
            ops.append(("remove", event.block_hashes))
        elif isinstance(event, AllCleared):
            ops.append(("clear", ()))
    return ops
