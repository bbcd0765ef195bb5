"""An LRU prefix cache of block hashes (the simulator's KV cache, without any KV).

Blocks hold a reference count: a running request pins its blocks and they cannot be evicted until it
releases them. Unreferenced blocks sit in an LRU list and are evicted oldest first when space is needed.
A chain is always touched tail first, so its head ends up the most recent: eviction then takes a chain's
tail before its head, as vLLM frees blocks, and a cached prefix never loses its middle.

Every change is reported as KV events (``BlockRemoved`` for evictions, ``BlockStored`` with its parent)
through ``on_events``, one list per operation. Plain Python, no asyncio.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

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
        # Check first so a bad call changes nothing.
        for h in hashes:
            if refs.get(h, 0) <= 0:
                raise ValueError(f"block {h:016x} is not pinned")
        lru = self._lru
        for h in reversed(hashes):  # tail first: the chain's head ends up most recent
            count = refs[h] - 1
            refs[h] = count
            if count == 0:
                lru[h] = None

    def store(self, hashes: Sequence[int], parent: int | None = None) -> int:
        """Cache the chain ``hashes`` (``parent``: the hash before ``hashes[0]``, None for a prompt's start).

        Blocks already cached are refreshed; new ones may evict unpinned blocks of other chains. When
        nothing can be evicted, storing stops: a block without its parent could never be matched.
        Returns how many blocks were newly stored.
        """
        refs, lru = self._refs, self._lru
        # Take the chain's cached, unpinned blocks out of the LRU so that storing its tail cannot evict
        # its own head; they go back below, head most recent.
        held = {h: None for h in hashes if refs.get(h) == 0}  # a dict: ordered and free of repeats
        for h in held:
            del lru[h]
        evicted: list[int] = []
        runs: list[tuple[int | None, list[int]]] = []  # (parent, contiguous new blocks)
        prev = parent
        stored = 0
        for h in hashes:
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
            held[h] = None
            stored += 1
            if runs and runs[-1][1][-1] == prev:
                runs[-1][1].append(h)
            else:
                runs.append((prev, [h]))
            prev = h
        for h in reversed(hashes):
            if h in held:
                lru[h] = None
        if self._on_events is not None and (evicted or runs):
            # Removals first: they are other chains' blocks, so this order gives the same final state.
            events: list[KvEvent] = [BlockRemoved(tuple(evicted))] if evicted else []
            events.extend(BlockStored(tuple(run), run_parent) for run_parent, run in runs)
            self._on_events(events)
        return stored
