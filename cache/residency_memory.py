"""The in-process residency index: the embedded default, and every gateway's routing view."""

from __future__ import annotations

import heapq
import math
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice, takewhile

from cache.events import KvEventBatch
from cache.residency import EngineHoldings, batch_ops

_SLOT_S = 0.25
_NONE: frozenset[int] = frozenset()
# A walk remembers, per engine, the prefix depths at multiples of this many blocks that it found held exactly,
# so that the next prompt resending that prefix (every turn of a conversation, every request under one
# system prompt) starts its walk there: a few dict probes instead of a membership test per block.
CHECKPOINT_BLOCKS = 16
MAX_VERIFIED = 2048  # remembered depths per engine (all forgotten at once past it): ~200 kB at most


class MemoryResidencyIndex:
    """Residency in sets and dicts. ``lookup`` is the synchronous read the gateway routes with.

    Exact entries are one set of block hashes per engine: KV events store and evict a prefill's hundreds of
    blocks at a time, and a set takes them in one C-level ``update`` / ``difference_update`` (a dict from
    block to holders cost four times as much per event, tests/bench/bench_residency.py). A lookup follows
    each engine holding the prompt's first block down the prompt with a C-level membership scan (~30 ns a
    block), from the deepest checkpoint of the prompt a past walk verified on that engine (remembered until
    its next removal), so it costs at most the sum of the matches' lengths, never the number of prefixes
    cached; a prefix every request resends costs a few dict probes. Approximate
    entries (a gateway's own records, with a TTL) live apart and are consulted only where a scan stops.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_soon_blocks: int = 1 << 20,
        checkpoint_blocks: int = CHECKPOINT_BLOCKS,
    ) -> None:
        if checkpoint_blocks < 1:
            raise ValueError("checkpoint_blocks must be positive")
        self._clock = clock
        self.checkpoint_blocks = checkpoint_blocks
        # Blocks "held soon" at most: about 70 MB at the default (the sets and the packed marks).
        self.max_soon_blocks = max_soon_blocks
        self._exact: dict[str, set[int]] = {}  # engine -> the blocks its KV events say it holds
        self._approx: dict[int, dict[str, float]] = {}  # hash -> {engine: expiry}
        self._approx_of: dict[str, set[int]] = {}  # engine -> its approximate blocks (never also exact)
        self._seq: dict[str, int] = {}
        # engine -> {hashes[d - 1]: d}: prefixes of d blocks (d a multiple of checkpoint_blocks) it held
        # exactly when a walk last checked them. Exact entries only grow between removals, so these stay
        # true until the engine's next removal or clear, which forgets them all. A chained hash names its
        # whole prefix (the ResidencyIndex contract), so one probe vouches for d blocks.
        self._verified: dict[str, dict[int, int]] = {}
        # Approximate entries grouped by the time slot (_SLOT_S) in which they expire, so a sweep costs
        # O(expired), not O(index). A refreshed entry also sits in its older slot; the sweep skips it there.
        self._buckets: dict[int, dict[str, set[int]]] = {}
        self._bucket_heap: list[int] = []
        # Blocks a routing decision has just sent to an engine and its KV events have yet to confirm ("held
        # soon"): a set per engine, so that marking a long prompt and walking it cost C-level set operations,
        # not a Python step per block as approximate entries do; with their expiries in a heap.
        self._soon: dict[str, set[int]] = {}
        self._soon_expiry: list[tuple[float, int, str, Sequence[int]]] = []
        self._soon_count = 0
        self._soon_marked = 0  # blocks in the marks of ``_soon_expiry``, bounded by ``max_soon_blocks``

    # -- synchronous core ------------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each engine holds: exactly, held soon, or approximately and alive."""
        return self.lookup_confirmed(hashes)[0]

    def lookup_confirmed(self, hashes: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """``lookup(hashes)``, and in the same walk how many of those blocks each engine's KV events
        confirmed before the first that they did not (a prefix "held soon" is not there yet to be pulled)."""
        if not hashes:
            return {}, {}
        now = self._clock()
        first = hashes[0]
        starters = [e for e, held in self._exact.items() if first in held]
        guesses = self._approx.get(first)
        if guesses:
            starters += [e for e, expiry in guesses.items() if expiry > now and e not in starters]
        starters += [e for e, soon in self._soon.items() if first in soon and e not in starters]
        matched: dict[str, int] = {}
        confirmed: dict[str, int] = {}
        step = self.checkpoint_blocks
        for engine in starters:
            held = self._exact.get(engine, _NONE)
            verified = self._verified.get(engine)
            start = _verified_depth(verified, hashes, step) if verified else 0
            soon = self._soon.get(engine, _NONE)
            depth, exact = self._depth(engine, held, soon, hashes, start, now)
            if exact >= start + step:
                self._remember(engine, verified, hashes, start, exact)
            matched[engine] = depth
            if exact:
                confirmed[engine] = exact
        return matched, confirmed

    def _remember(
        self, engine: str, verified: dict[int, int] | None, hashes: Sequence[int], start: int, exact: int
    ) -> None:
        """Record that ``engine`` holds ``hashes[:exact]`` exactly, at the checkpoints past ``start``."""
        if verified is None or len(verified) >= MAX_VERIFIED:
            verified = self._verified[engine] = {}
            start = 0
        step = self.checkpoint_blocks
        for d in range(start + step, exact + 1, step):
            verified[hashes[d - 1]] = d

    def _depth(
        self,
        engine: str,
        held: AbstractSet[int],
        soon: AbstractSet[int],
        hashes: Sequence[int],
        depth: int,
        now: float,
    ) -> tuple[int, int]:
        """How many leading blocks of ``hashes`` ``engine`` holds (exactly, held soon, or approximately and
        alive), and how many of them it holds exactly before the first that is not, knowing that it holds
        the first ``depth`` exactly."""
        approx = self._approx
        n = len(hashes)
        exact = -1  # not left the exact run yet
        # One iterator for the whole walk: an islice made at each stop would skip ``depth`` elements again
        # every time (quadratic: 79 ms for 6,250 approximate blocks). A takewhile also takes from ``rest``
        # the block it stops at: that block, ``hashes[depth]``, is then checked by hand.
        rest = islice(hashes, depth, None)
        while depth < n:
            # The common case, at C speed: a run of blocks this engine holds exactly.
            depth += len(list(takewhile(held.__contains__, rest)))
            if depth == n:
                break
            h = hashes[depth]
            if exact < 0:
                exact = depth
            if h in soon:  # a run held soon, at C speed too
                depth += 1 + len(list(takewhile(soon.__contains__, rest)))
                if depth == n:
                    break
                h = hashes[depth]
                if h in held:
                    depth += 1
                    continue
            if not approx:
                break
            guesses = approx.get(h)
            if guesses is None or guesses.get(engine, 0.0) <= now:
                break
            depth += 1  # an approximate entry continues the match
        return depth, depth if exact < 0 else exact

    def hold_soon_now(self, engine: str, hashes: Sequence[int], ttl_s: float) -> None:
        """``engine`` will hold ``hashes`` once the prefill a routing decision just sent there runs: count
        them until its KV events confirm them (an exact add takes them out of this state), ``ttl_s`` at
        most."""
        if not hashes:
            return
        self._soon.setdefault(engine, set()).update(hashes)
        self._soon_count += 1
        # Kept until the mark expires: packed, 8 bytes a block, not a list holding an int object per block.
        try:
            kept: Sequence[int] = array("Q", hashes)
        except OverflowError:  # (a hash that is no unsigned 64-bit integer: not one of ours)
            kept = tuple(hashes)
        heapq.heappush(self._soon_expiry, (self._clock() + ttl_s, self._soon_count, engine, kept))
        self._soon_marked += len(kept)
        # A flood of long new prompts (or of prompts the engines refuse, which no event ever confirms) must
        # not hold memory without bound: past the bound the marks that would expire first go now.
        while self._soon_marked > self.max_soon_blocks:
            self._pop_soon()

    def _pop_soon(self) -> None:
        _, _, engine, hashes = heapq.heappop(self._soon_expiry)
        self._soon_marked -= len(hashes)
        self.forget_soon_now(engine, hashes)  # (a later twin's mark of the same blocks goes too)

    def forget_soon_now(self, engine: str, hashes: Iterable[int]) -> None:
        """Take back ``hold_soon_now`` (the engine never took the request)."""
        soon = self._soon.get(engine)
        if soon:
            soon.difference_update(hashes)

    def held_soon_now(self, engine: str) -> frozenset[int]:
        return frozenset(self._soon.get(engine, ()))

    def add_now(self, engine: str, hashes: Sequence[int], ttl_s: float | None = None) -> None:
        if not hashes:
            return
        exact = self._exact.setdefault(engine, set())
        if ttl_s is None:
            exact.update(hashes)
            self._forget_approx(engine, hashes)  # an exact entry replaces this engine's approximate one
            soon = self._soon.get(engine)
            if soon:
                soon.difference_update(hashes)  # confirmed
            return
        approx = self._approx
        expiry = self._clock() + ttl_s
        added = []
        for h in hashes:
            if h in exact:
                continue  # an approximate add never downgrades an exact entry
            holders = approx.get(h)
            if holders is None:
                approx[h] = {engine: expiry}
            elif holders.get(engine, 0.0) < expiry:
                holders[engine] = expiry
            added.append(h)
        if added:
            self._approx_of.setdefault(engine, set()).update(added)
            self._file_expiry(engine, expiry, added)

    def _file_expiry(self, engine: str, expiry: float, hashes: Iterable[int]) -> None:
        slot = math.floor(expiry / _SLOT_S)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = {}
            heapq.heappush(self._bucket_heap, slot)
        bucket.setdefault(engine, set()).update(hashes)

    def remove_now(self, engine: str, hashes: Iterable[int]) -> None:
        hashes = hashes if isinstance(hashes, (set, frozenset, list, tuple)) else list(hashes)
        exact = self._exact.get(engine)
        if exact is not None:
            held = len(exact)
            exact.difference_update(hashes)
            if len(exact) != held:
                self._verified.pop(engine, None)  # a remembered prefix may have lost a block
        self._forget_approx(engine, hashes)
        self.forget_soon_now(engine, hashes)

    def clear_now(self, engine: str) -> None:
        self._exact.pop(engine, None)
        self._verified.pop(engine, None)
        self._soon.pop(engine, None)
        self._forget_approx(engine, list(self._approx_of.get(engine, ())))

    def _forget_approx(self, engine: str, hashes: Iterable[int]) -> None:
        """Drop ``engine``'s approximate entries for ``hashes`` (nearly always it has none: one check)."""
        approx_of = self._approx_of.get(engine)
        if not approx_of:
            return
        approx = self._approx
        for h in approx_of.intersection(hashes):
            holders = approx[h]
            del holders[engine]
            if not holders:
                del approx[h]
        approx_of.difference_update(hashes)

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

    def held_count_now(self, engine: str) -> int:
        """How many blocks ``engine`` holds by this view (exact and approximate): its share of the cache."""
        return len(self._exact.get(engine, _NONE)) + len(self._approx_of.get(engine, _NONE))

    def holds_exactly(self, engine: str, block_hash: int) -> bool:
        return block_hash in self._exact.get(engine, _NONE)

    def sweep_now(self) -> int:
        now = self._clock()
        dropped = 0
        while self._soon_expiry and self._soon_expiry[0][0] <= now:
            self._pop_soon()  # never confirmed in time
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
                    self._approx_of.get(engine, set()).discard(h)
                dropped += len(expired)
        for engine, expiry, h in refile:
            self._file_expiry(engine, expiry, (h,))
        return dropped

    def __len__(self) -> int:
        """Number of (block, engine) entries."""
        return sum(map(len, self._exact.values())) + sum(map(len, self._approx_of.values()))

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
        approximate: dict[int, float] = {}
        for h in self._approx_of.get(engine, ()):
            expiry = self._approx[h][engine]
            if expiry > now:
                approximate[h] = expiry - now
        return EngineHoldings(self._seq.get(engine), frozenset(self._exact.get(engine, ())), approximate)

    async def engines(self) -> list[str]:
        return self.engines_now()

    def engines_now(self) -> list[str]:
        exact = [e for e, held in self._exact.items() if held]
        return sorted(set(self._seq).union(exact, (e for e, held in self._approx_of.items() if held)))

    async def sweep(self) -> int:
        return self.sweep_now()


def _verified_depth(verified: dict[int, int], hashes: Sequence[int], step: int) -> int:
    """The deepest checkpoint of ``hashes`` (every ``step`` blocks) that ``verified`` vouches for (0: none),
    probed from the first up: a walk records every checkpoint up to the depth it found, so the first miss
    ends the climb."""
    depth = 0
    for d in range(step, len(hashes) + 1, step):
        if verified.get(hashes[d - 1]) != d:
            break
        depth = d
    return depth
