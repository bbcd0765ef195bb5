"""An LRU prefix cache of block hashes (the simulator's KV cache, without any KV).

Blocks hold a reference count: a running request pins its blocks and they cannot be evicted until it
releases them. Unreferenced blocks sit in an LRU list and are evicted oldest first when space is needed.
A chain is always touched tail first, so its head ends up the most recent: eviction then takes a chain's
tail before its head, as vLLM frees blocks, and a cached prefix never loses its middle.

Every change is reported as KV events (``BlockRemoved`` for evictions, ``BlockStored`` with its parent)
through ``on_events``, one list per operation. Plain Python, no asyncio.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Sequence
from itertools import repeat

from cache.events import BlockRemoved, BlockStored, KvEvent

EventSink = Callable[[list[KvEvent]], object]  # a publisher may return the batch it made


class PrefixCache:
    """Block hashes with reference counts and LRU eviction of the unreferenced ones."""

    def __init__(self, capacity_blocks: int, on_events: EventSink | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.capacity = capacity_blocks
        self._on_events = on_events
        self._refs: dict[int, int] = {}  # every cached block -> how many running requests pin it
        self._lru: OrderedDict[int, None] = OrderedDict()  # the unpinned ones, least recently used first
        # Blocks stored for a prefill that has not run yet -> how many such prefills: cached for the prompts
        # queued behind it (FIFO: they run after it), but no K/V to send a peer yet.
        self._computing: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._refs

    @property
    def used(self) -> int:
        return len(self._refs)

    @property
    def free(self) -> int:
        return self.capacity - len(self._refs)

    @property
    def pinned(self) -> int:
        """Blocks pinned by at least one request."""
        return len(self._refs) - len(self._lru)

    def refcount(self, block_hash: int) -> int:
        return self._refs.get(block_hash, 0)

    def lru_order(self) -> list[int]:
        """The evictable blocks, next victim first."""
        return list(self._lru)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached. A probe: recency is left alone."""
        refs = self._refs
        n = 0
        for h in hashes:
            if h not in refs:
                break
            n += 1
        return n

    def match_computed(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are cached with their K/V computed (what a pull can send)."""
        n = self.match(hashes)
        computing = self._computing
        if computing:
            for i in range(n):
                if hashes[i] in computing:
                    return i
        return n

    def computing(self, hashes: Sequence[int]) -> None:
        """Mark ``hashes`` (stored, pinned by the request computing them) as not yet computed."""
        computing = self._computing
        for h in hashes:
            computing[h] = computing.get(h, 0) + 1

    def computed(self, hashes: Sequence[int]) -> None:
        """The prefill that :meth:`computing` was called for ran (or will never run)."""
        computing = self._computing
        for h in hashes:
            count = computing.get(h, 0) - 1
            if count > 0:
                computing[h] = count
            else:
                computing.pop(h, None)

    def acquire(self, hashes: Sequence[int]) -> list[int]:
        """Pin every cached block of ``hashes``; returns the pinned ones, to pass to :meth:`release`."""
        refs, lru = self._refs, self._lru
        pinned = []
        for h in hashes:
            count = refs.get(h)
            if count is None:
                continue
            if count == 0:
                del lru[h]
            refs[h] = count + 1
            pinned.append(h)
        return pinned

    def release(self, hashes: Sequence[int]) -> None:
        """Unpin blocks pinned by :meth:`acquire`; a block nobody pins becomes the most recently used."""
        refs = self._refs
        # Check first so that a bad call changes nothing; chains repeat no hash, so the exact count per
        # block is needed only in the rare call that does.
        if len(set(hashes)) == len(hashes):
            ok = min(map(refs.get, hashes, repeat(0)), default=1) > 0
        else:
            ok = all(refs.get(h, 0) >= n for h, n in Counter(hashes).items())
        if not ok:
            raise ValueError("release() of blocks that are not pinned (as often as given)")
        lru = self._lru
        for h in reversed(hashes):  # tail first: the chain's head ends up most recent
            count = refs[h] - 1
            refs[h] = count
            if not count:
                lru[h] = None

    def demote(self, hashes: Sequence[int]) -> None:
        """Make the unpinned blocks of a chain the next to be evicted, its last block first (a peer pulled
        them and holds them now, so this copy is the one to give up). Nothing leaves: no events."""
        lru = self._lru
        for h in hashes:
            if h in lru:
                lru.move_to_end(h, last=False)

    def discard(self, hashes: Sequence[int]) -> None:
        """Remove a chain's unpinned blocks from its tail back, as far as the first pinned one (a request
        that pins a block pins its parents too, so no block is left without its parent): blocks cached for a
        prefill that never ran."""
        refs, lru = self._refs, self._lru
        removed: list[int] = []
        for h in reversed(hashes):
            if refs.get(h) != 0:
                if h in refs:
                    break  # pinned: it and its parents stay
                continue  # not cached (evicted meanwhile)
            del refs[h]
            del lru[h]
            removed.append(h)
        if removed and self._on_events is not None:
            self._on_events([BlockRemoved(tuple(removed))])

    def store(self, hashes: Sequence[int], parent: int | None = None) -> int:
        """Cache the chain ``hashes`` (``parent``: the hash before ``hashes[0]``, None for a prompt's start).

        Blocks already cached are refreshed; new ones may evict unpinned blocks of other chains. When
        nothing can be evicted, storing stops: a block without its parent could never be matched.
        Returns how many blocks were newly stored.
        """
        refs, lru = self._refs, self._lru
        n = len(hashes)
        start = self.match(hashes)
        if start == n:  # all cached already (a repeated prompt): only recency changes
            self._touch(hashes)
            return 0
        if len(refs) + (n - start) > self.capacity:
            # Eviction may be needed: take the chain's own unpinned blocks out of the LRU so that storing
            # its tail cannot evict its head. They go back at the end, like the new ones.
            for h in hashes:
                if refs.get(h) == 0:
                    lru.pop(h, None)
            new_into_lru = False
        else:
            new_into_lru = True  # everything fits: nothing will be evicted
        evicted: list[int] = []
        runs: list[tuple[int | None, list[int]]] = []  # (parent, contiguous new blocks)
        prev = hashes[start - 1] if start else parent
        stored = 0
        for i in range(start, n):
            h = hashes[i]
            if h in refs:
                prev = h
                continue
            if len(refs) >= self.capacity:
                if not lru:
                    break
                victim, _ = lru.popitem(last=False)
                del refs[victim]
                evicted.append(victim)
            refs[h] = 0
            if new_into_lru:
                lru[h] = None
            stored += 1
            if runs and runs[-1][1][-1] == prev:
                runs[-1][1].append(h)
            else:
                runs.append((prev, [h]))
            prev = h
        self._touch(hashes)
        if self._on_events is not None and (evicted or runs):
            # Removals first: they are other chains' blocks, so this order gives the same final state.
            events: list[KvEvent] = [BlockRemoved(tuple(evicted))] if evicted else []
            events.extend(BlockStored(tuple(run), run_parent) for run_parent, run in runs)
            self._on_events(events)
        return stored

    def _touch(self, hashes: Sequence[int]) -> None:
        """Make the chain's unpinned blocks the most recent, tail first so that its head ends up last."""
        lru = self._lru
        try:
            # The common case, every block unpinned and in the LRU, at C speed.
            deque(map(lru.move_to_end, reversed(hashes)), maxlen=0)
            return
        except KeyError:
            pass  # some are pinned or held out by store(): redo it block by block (same final order)
        refs = self._refs
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            elif refs.get(h) == 0:  # held out of the LRU by store()
                lru[h] = None
