"""Paged KV-cache blocks: allocation, reference counts, prefix caching and LRU eviction.

A full block that has been computed is entered into the prefix cache under its chain hash (contract 1).
A later sequence whose prompt starts with the same blocks shares them (reference count + 1) instead of
computing them again; the block's token ids are compared on every hit, so a hash collision can cost a
recomputation but never a wrong answer. Blocks nobody references stay cached until they are needed, then
go least recently used first; every change to what is cached becomes a KV event (contract 3).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced and holding nothing cached
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced but cached; oldest first
        self._by_hash: dict[int, int] = {}
        self._events: list[KvEvent] = []

    # -- accounting -------------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._by_hash)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -----------------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, leaving at least one token to compute (the
        step that computes it produces the next token's logits) unless ``seq`` only exports its K/V."""
        limit = (seq.num_tokens if seq.export is not None else seq.num_tokens - 1) // self.block_size
        matched = []
        for i, h in enumerate(seq.block_hashes(self.block_size)[:limit]):
            block_id = self._by_hash.get(h)
            if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(i, self.block_size):
                break
            matched.append(block_id)
        return matched

    def can_allocate(self, seq: Sequence) -> bool:
        matched = self.match_prefix(seq)
        reclaimed = sum(1 for b in matched if b in self._evictable)  # cached blocks it would pin
        return self.blocks_for(seq.num_tokens) - len(matched) <= self.num_free - reclaimed

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its tokens, sharing its cached prefix. Returns the cached tokens."""
        assert not seq.block_table and seq.num_computed == 0
        matched = self.match_prefix(seq)
        for block_id in matched:
            self._ref(block_id)
        seq.block_table = matched + [
            self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(matched))
        ]
        seq.num_computed = len(matched) * self.block_size
        seq.num_registered = len(matched)
        return seq.num_computed

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens of K/V (decode appends one block at a time)."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter the blocks ``seq`` has fully computed into the prefix cache (one stored event per call)."""
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        hashes = seq.block_hashes(self.block_size)
        stored: list[int] = []
        parent = hashes[seq.num_registered - 1] if seq.num_registered else None
        for i in range(seq.num_registered, full):
            block = self.blocks[seq.block_table[i]]
            h = hashes[i]
            if block.hash is None and h not in self._by_hash:
                block.hash, block.token_ids = h, seq.block_tokens(i, self.block_size)
                self._by_hash[h] = block.block_id
                stored.append(h)
            # else: another sequence computed the same block first; ours stays a private copy
        seq.num_registered = full
        if stored:
            self._events.append(BlockStored(tuple(stored), parent))

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks. Tail blocks are released first so they are also evicted first: a
        prefix is never left without its parent."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free.append(block_id)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def demote(self, block_ids: list[int]) -> None:
        """Move the unreferenced blocks of a cached run (``block_ids`` in prefix order) to the front of the
        eviction order, the run's last block first: a peer engine pulled their K/V and now holds it, so this
        copy is the one to give up first (a pull migrates a prefix instead of duplicating it). Blocks a
        sequence still references are left alone. Nothing leaves the cache, so no KV event is emitted."""
        for block_id in block_ids:  # each goes to the very front: the last one ends up first of all
            if block_id in self._evictable:
                self._evictable.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that nobody uses (referenced blocks stay, but are no longer shared)."""
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._by_hash.clear()
        self._events.append(AllCleared())

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    # -- internals --------------------------------------------------------------------------------------

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _take(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.hash is not None
            del self._by_hash[block.hash]
            self._events.append(BlockRemoved((block.hash,)))
            block.hash, block.token_ids = None, ()
        self.blocks[block_id].ref_count = 1
        return block_id
