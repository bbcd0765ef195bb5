"""The in-process residency index: the embedded default, and every gateway's routing view."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, repeat
from operator import is_not

from cache.events import KvEventBatch
from cache.residency import EngineHoldings, batch_ops

_SLOT_S = 0.25


class MemoryResidencyIndex:
    """Residency in dicts. ``lookup`` is the synchronous read the gateway routes with.

    Exact and approximate entries live apart: the common case of a lookup (every engine still matching
    holds the next block exactly) is then one dict probe and one C-level set comparison per block, and
    the cost never depends on how many prefixes are cached in total.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # hash -> engines holding it (from KV events). The sets are immutable and a block held by one
        # engine shares that engine's one singleton, so storing a prefill's hundreds of new blocks is a
        # few C-level dict and set operations rather than a set built per block.
        self._exact: dict[int, frozenset[str]] = {}
        self._singletons: dict[str, frozenset[str]] = {}
        self._approx: dict[int, dict[str, float]] = {}  # hash -> {engine: expiry}
        self._by_engine: dict[str, set[int]] = {}
        self._seq: dict[str, int] = {}
        # Approximate entries grouped by the time slot (_SLOT_S) in which they expire, so a sweep costs
        # O(expired), not O(index). A refreshed entry also sits in its older slot; the sweep skips it there.
        self._buckets: dict[int, dict[str, set[int]]] = {}
        self._bucket_heap: list[int] = []

    # -- synchronous core ------------------------------------------------------------------------------

    def _holders(self, h: int, now: float) -> set[str]:
        exact = self._exact.get(h)
        approx = self._approx.get(h)
        if approx is None:
            return set(exact) if exact else set()
        live = {e for e, expiry in approx.items() if expiry > now}
        return live | exact if exact else live

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        if not hashes:
            return {}
        now = self._clock()
        alive = self._holders(hashes[0], now)
        if not alive:
            return {}
        exact = self._exact
        matched: dict[str, int] = {}
        for depth in range(1, len(hashes)):
            h = hashes[depth]
            held = exact.get(h)
            if held is not None and alive <= held:
                continue  # the common case: every engine still matching holds this block exactly
            holders = self._holders(h, now)
            if alive <= holders:
                continue
            for e in alive - holders:
                matched[e] = depth
            alive &= holders
            if not alive:
                return matched
        for e in alive:
            matched[e] = len(hashes)
        return matched

    def add_now(self, engine: str, hashes: Sequence[int], ttl_s: float | None = None) -> None:
        if not hashes:
            return
        owned = self._by_engine.setdefault(engine, set())
        exact, approx = self._exact, self._approx
        if ttl_s is None:
            single = self._singletons.get(engine)
            if single is None:
                single = self._singletons[engine] = frozenset((engine,))
            shared = {h: exact[h] for h in exact.keys() & hashes}  # blocks other engines hold too
            exact.update(dict.fromkeys(hashes, single))
            for h, others in shared.items():
                exact[h] = others if engine in others else others | single
            if approx:
                for h in approx.keys() & hashes:
                    if approx[h].pop(engine, None) is not None and not approx[h]:
                        del approx[h]
            owned.update(hashes)
            return
        expiry = self._clock() + ttl_s
        added = []
        for h in hashes:
            holders = exact.get(h)
            if holders is not None and engine in holders:
                continue  # an approximate add never downgrades an exact entry
            guesses = approx.get(h)
            if guesses is None:
                approx[h] = {engine: expiry}
            elif guesses.get(engine, 0.0) < expiry:
                guesses[engine] = expiry
            added.append(h)
        if added:
            owned.update(added)
            self._file_expiry(engine, expiry, added)

    def _file_expiry(self, engine: str, expiry: float, hashes: Iterable[int]) -> None:
        slot = math.floor(expiry / _SLOT_S)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = {}
            heapq.heappush(self._bucket_heap, slot)
        bucket.setdefault(engine, set()).update(hashes)

    def remove_now(self, engine: str, hashes: Iterable[int]) -> None:
        exact, approx = self._exact, self._approx
        hashes = hashes if isinstance(hashes, (set, frozenset, list, tuple)) else list(hashes)
        # Evictions come by the hundred and nearly all were held by this engine alone: pop every entry in
        # C-level loops, then put back, without this engine, the few that other engines hold too.
        known = list(exact.keys() & hashes)
        popped = list(map(exact.pop, known))
        alone = self._singletons.get(engine, frozenset((engine,)))
        shared = list(map(is_not, popped, repeat(alone)))  # not this engine's singleton
        for h, held in zip(compress(known, shared), compress(popped, shared), strict=True):
            rest = held - alone
            if rest:
                exact[h] = rest
        if approx:
            for h in approx.keys() & hashes:
                guesses = approx[h]
                if guesses.pop(engine, None) is not None and not guesses:
                    del approx[h]
        owned = self._by_engine.get(engine)
        if owned is not None:
            owned.difference_update(hashes)

    def clear_now(self, engine: str) -> None:
        owned = self._by_engine.pop(engine, set())
        self.remove_now(engine, owned)

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

    def holds_exactly(self, engine: str, block_hash: int) -> bool:
        return engine in self._exact.get(block_hash, ())

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
                    expiry = self._approx.get(h, {}).get(engine)
                    if expiry is None:
                        continue
                    if expiry <= now:
                        expired.append(h)
                    else:
                        refile.append((engine, expiry, h))  # the slot in progress: not yet expired
                for h in expired:
                    guesses = self._approx[h]
                    del guesses[engine]
                    if not guesses:
                        del self._approx[h]
                    if not self.holds_exactly(engine, h):
                        self._by_engine.get(engine, set()).discard(h)
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
            if self.holds_exactly(engine, h):
                exact.add(h)
                continue
            expiry = self._approx.get(h, {}).get(engine, 0.0)
            if expiry > now:
                approximate[h] = expiry - now
        return EngineHoldings(self._seq.get(engine), frozenset(exact), approximate)

    async def engines(self) -> list[str]:
        return self.engines_now()

    def engines_now(self) -> list[str]:
        return sorted(set(self._seq) | {e for e, owned in self._by_engine.items() if owned})

    async def sweep(self) -> int:
        return self.sweep_now()
