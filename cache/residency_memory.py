"""The in-process residency index: the embedded default, and every gateway's routing view."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence

from cache.events import KvEventBatch
from cache.residency import EngineHoldings, batch_ops

_EXACT = math.inf
_SLOT_S = 0.25


class MemoryResidencyIndex:
    """Residency in dicts. ``lookup`` is the synchronous read the gateway routes with.

    Cost of a lookup: one dict probe per matched block and per engine still matching, independent of how
    many prefixes are cached in total.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._holders: dict[int, dict[str, float]] = {}  # hash -> {engine: expiry (inf = exact)}
        self._by_engine: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}
        # Approximate entries grouped by the time slot (_SLOT_S) in which they expire, so a sweep costs
        # O(expired), not O(index). A refreshed entry also sits in its older slot; the sweep skips it there.
        self._buckets: dict[int, dict[str, set[int]]] = {}
        self._bucket_heap: list[int] = []

    # -- synchronous core ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        now = self._clock()
        first = self._holders.get(hashes[0])
        if not first:
            return {}
        alive = [e for e, expiry in first.items() if expiry > now]
        if not alive:
            return {}
        matched: dict[str, int] = {}
        depth = 1
        for depth in range(1, len(hashes)):
            holders = self._holders.get(hashes[depth])
            if not holders:
                break
            still = [e for e in alive if holders.get(e, 0.0) > now]
            if len(still) != len(alive):
                for e in alive:
                    if holders.get(e, 0.0) <= now:
                        matched[e] = depth
                alive = still
                if not alive:
                    break
        else:
            depth = len(hashes)
        for e in alive:
            matched[e] = depth
        return matched

    def add_now(self, engine: str, hashes: Sequence[int], ttl_s: float | None = None) -> None:
        expiry = _EXACT if ttl_s is None else self._clock() + ttl_s
        owned = self._by_engine.setdefault(engine, set())
        if ttl_s is not None and hashes:
            self._file_expiry(engine, expiry, hashes)
        for h in hashes:
            holders = self._holders.setdefault(h, {})
            if holders.get(engine, 0.0) < expiry:
                holders[engine] = expiry
            owned.add(h)

    def _file_expiry(self, engine: str, expiry: float, hashes: Iterable[int]) -> None:
        slot = math.floor(expiry / _SLOT_S)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = {}
            heapq.heappush(self._bucket_heap, slot)
        bucket.setdefault(engine, set()).update(hashes)

    def remove_now(self, engine: str, hashes: Sequence[int]) -> None:
        owned = self._by_engine.get(engine)
        for h in hashes:
            holders = self._holders.get(h)
            if holders is not None and holders.pop(engine, None) is not None and not holders:
                del self._holders[h]
            if owned is not None:
                owned.discard(h)

    def clear_now(self, engine: str) -> None:
        owned = self._by_engine.pop(engine, set())
        self.remove_now(engine, list(owned))

    def apply_now(self, engine: str, batch: KvEventBatch) -> bool:
        last = self._seq.get(engine)
        if last is not None and batch.seq <= last:
            return False
        self._seq[engine] = batch.seq
        for op, hashes in batch_ops(batch):
            if op == "add":
                self.add_now(engine, hashes)
            elif op == "remove":
                self.remove_now(engine, hashes)
            else:
                self.clear_now(engine)
        return True

    def replace_now(self, engine: str, hashes: Sequence[int], seq: int) -> None:
        self.clear_now(engine)
        self.add_now(engine, hashes)
        self._seq[engine] = seq

    def seq_of(self, engine: str) -> int | None:
        return self._seq.get(engine)

    def sweep_now(self) -> int:
        now = self._clock()
        dropped = 0
        refile: list[tuple[str, float, int]] = []
        while self._bucket_heap and self._bucket_heap[0] * _SLOT_S <= now:
            bucket = self._buckets.pop(heapq.heappop(self._bucket_heap))
            for engine, hashes in bucket.items():
                # Entries may have been refreshed, made exact or removed since: drop only the expired ones.
                expired = []
                for h in hashes:
                    expiry = self._holders.get(h, {}).get(engine, 0.0)
                    if 0.0 < expiry <= now:
                        expired.append(h)
                    elif now < expiry < _EXACT:
                        refile.append((engine, expiry, h))  # the slot in progress: not yet expired
                self.remove_now(engine, expired)
                dropped += len(expired)
        for engine, expiry, h in refile:
            self._file_expiry(engine, expiry, (h,))
        return dropped

    def __len__(self) -> int:
        """Number of (block, engine) entries."""
        return sum(len(owned) for owned in self._by_engine.values())

    # -- the ResidencyIndex protocol ---------------------------------------------------------------------

    async def add(self, engine: str, hashes: Sequence[int], *, ttl_s: float | None = None) -> None:
        self.add_now(engine, hashes, ttl_s)

    async def remove(self, engine: str, hashes: Sequence[int]) -> None:
        self.remove_now(engine, hashes)

    async def clear(self, engine: str) -> None:
        self.clear_now(engine)

    async def apply(self, engine: str, batch: KvEventBatch) -> bool:
        return self.apply_now(engine, batch)

    async def replace(self, engine: str, hashes: Sequence[int], seq: int) -> None:
        self.replace_now(engine, hashes, seq)

    async def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        return self.lookup(hashes)

    async def holdings(self, engine: str) -> EngineHoldings:
        now = self._clock()
        exact: set[int] = set()
        approximate: dict[int, float] = {}
        for h in self._by_engine.get(engine, ()):
            expiry = self._holders.get(h, {}).get(engine, 0.0)
            if expiry == _EXACT:
                exact.add(h)
            elif expiry > now:
                approximate[h] = expiry - now
        return EngineHoldings(self._seq.get(engine), frozenset(exact), approximate)

    async def engines(self) -> list[str]:
        return sorted(set(self._seq) | {e for e, owned in self._by_engine.items() if owned})

    async def sweep(self) -> int:
        return self.sweep_now()
