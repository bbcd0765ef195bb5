"""Paged KV-cache blocks: allocation, reference counts, prefix caching and LRU eviction.

A full block that has been computed is entered into the prefix cache under its chain hash (contract 1).
A later sequence whose prompt starts with the same blocks shares them (reference count + 1) instead of
computing them again. A hit is checked without trusting the hash: each reused block's own token ids must
match, and it must be the child of the block reused just before it (the very block its K/V was computed
after, or one found identical to it), so a hash collision, forged or not, can cost a recomputation but never
a wrong answer. Blocks nobody references stay cached until they are needed, then go least recently used
first; every change to what is cached becomes a KV event (contract 3).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from engine.sequence import Sequence

# A cached block as a parent: (block id, generation). A block's generation rises whenever what it held
# leaves the cache, so a link names one cached content, never a later one in the same memory.
Link = tuple[int, int]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: Link | None = None  # while cached: the block its K/V was computed after (None: the first block)
    generation: int = 0
    # A private block that holds the same content as a cached one (computed twice, stored once): that one,
    # which its sequence's next block names as its parent.
    same_as: Link | None = None


@dataclass(slots=True)
class _Match:
    """A waiting sequence's prefix match, kept between scheduler steps."""

    block_ids: list[int]
    generations: list[int]
    uncached: int  # BlockManager.uncached when the blocks were last known to be cached
    rejected: Link | None = None  # the cached block that ended the walk: same generation, same verdict


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
        self._matches: dict[Sequence, _Match] = {}  # waiting sequences' matches (see can_allocate)
        self.uncached = 0  # blocks that ever left the prefix cache
        self.prefix_walks = 0  # walks along the prefix cache (a remembered match that still holds costs none)

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
        match = _Match([], [], self.uncached)
        self._walk(seq, match, self._limit(seq))
        return match.block_ids

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` its cached prefix holds now (``match_prefix``'s), remembered as ``can_allocate``
        remembers it: the walk is not made again when the sequence reaches the head of the queue."""
        return len(self._remembered_match(seq)) * self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether ``seq`` fits now. Its match is remembered until it is allocated (or :meth:`forget`), so a
        prompt waiting at the head of the queue is walked again only once the cache may hold more of it."""
        matched = self._remembered_match(seq)
        reclaimed = sum(1 for b in matched if b in self._evictable)  # cached blocks it would pin
        return self.blocks_for(seq.num_tokens) - len(matched) <= self.num_free - reclaimed

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its tokens, sharing its cached prefix. Returns the cached tokens."""
        assert not seq.block_table and seq.num_computed == 0
        matched = list(self._remembered_match(seq))
        self._matches.pop(seq, None)
        for block_id in matched:
            self._ref(block_id)
        seq.block_table = matched + [
            self._take() for _ in range(self.blocks_for(seq.num_tokens) - len(matched))
        ]
        seq.num_computed = len(matched) * self.block_size
        seq.num_registered = len(matched)
        return seq.num_computed

    def forget(self, seq: Sequence) -> None:
        """Drop what :meth:`can_allocate` remembered of ``seq``: it left the queue unallocated."""
        self._matches.pop(seq, None)

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(seq.block_table) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make room for ``num_tokens`` tokens of K/V (decode appends one block at a time)."""
        while len(seq.block_table) * self.block_size < num_tokens:
            seq.block_table.append(self._take())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Enter the blocks ``seq`` has fully computed into the prefix cache: one stored event per run of
        consecutive blocks entered, naming the block before the run as its parent (vLLM's
        ``parent_block_hash``). A block another sequence entered first, with the same tokens after the same
        parent, stays a private copy; one whose hash is taken by different content (a collision) ends the
        run for good: nothing computed after it can be linked to a cached parent."""
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered:
            return
        hashes = seq.block_hashes(self.block_size)
        run: list[int] = []
        run_start = seq.num_registered
        for i in range(seq.num_registered, full):
            parent = self._link_of(seq.block_table[i - 1]) if i else None
            if i and parent is None:
                break  # the block before is not (or no longer) in the cache: nothing could find this one
            block = self.blocks[seq.block_table[i]]
            h = hashes[i]
            tokens = seq.block_tokens(i, self.block_size)
            cached_id = self._by_hash.get(h)
            if cached_id is not None and self._orphaned(cached_id):
                # Its parent left the cache, so no walk can reach it (tail-first eviction makes this rare:
                # a parent shared through a duplicate can go first). Ours takes its place.
                self._uncache(cached_id)
                cached_id = None
            if cached_id is None and block.hash is None:
                block.hash, block.token_ids, block.parent = h, tokens, parent
                self._by_hash[h] = block.block_id
                run.append(h)
                continue
            if cached_id is not None:
                cached = self.blocks[cached_id]
                if cached.token_ids == tokens and cached.parent == parent:
                    block.same_as = (cached_id, cached.generation)
            self._stored(run, hashes, run_start)
            run, run_start = [], i + 1
        seq.num_registered = full
        self._stored(run, hashes, run_start)

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
        for block_id in list(self._evictable):  # to the free list, least recently used first
            self._uncache(block_id, announce=False)
        for block in self.blocks:
            if block.hash is not None:  # referenced: it stays with its sequences
                self._uncache(block.block_id, announce=False)
        self._events.append(AllCleared())

    def drain_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash)

    # -- internals --------------------------------------------------------------------------------------

    def _limit(self, seq: Sequence) -> int:
        return (seq.num_tokens if seq.export is not None else seq.num_tokens - 1) // self.block_size

    def _remembered_match(self, seq: Sequence) -> list[int]:
        """``match_prefix(seq)``, walking only from where the remembered match may have changed: the first
        of its blocks to have left the cache, or its end when the cache now holds a candidate after it."""
        limit = self._limit(seq)
        match = self._matches.get(seq)
        if match is None:
            match = self._matches[seq] = _Match([], [], self.uncached)
            self._walk(seq, match, limit)
            return match.block_ids
        keep = min(len(match.block_ids), limit)
        if match.uncached != self.uncached:  # some block left the cache since: is it one of ours?
            ids, gens, blocks = match.block_ids, match.generations, self.blocks
            keep = next((i for i in range(keep) if blocks[ids[i]].generation != gens[i]), keep)
            match.uncached = self.uncached
        if keep < len(match.block_ids):
            del match.block_ids[keep:], match.generations[keep:]
            match.rejected = None
        if keep < limit:
            candidate = self._by_hash.get(seq.block_hashes(self.block_size)[keep])
            if candidate is not None and (candidate, self.blocks[candidate].generation) != match.rejected:
                self._walk(seq, match, limit)
        return match.block_ids

    def _walk(self, seq: Sequence, match: _Match, limit: int) -> None:
        """Extend ``match`` along the cache: block i is reused if it holds ``seq``'s tokens of block i and
        is the child of the block reused at i - 1."""
        self.prefix_walks += 1
        hashes = seq.block_hashes(self.block_size)
        parent = (match.block_ids[-1], match.generations[-1]) if match.block_ids else None
        match.rejected = None
        for i in range(len(match.block_ids), limit):
            block_id = self._by_hash.get(hashes[i])
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent != parent or block.token_ids != seq.block_tokens(i, self.block_size):
                match.rejected = (block_id, block.generation)
                break
            parent = (block_id, block.generation)
            match.block_ids.append(block_id)
            match.generations.append(block.generation)

    def _link_of(self, block_id: int) -> Link | None:
        """The cached block holding what ``block_id`` (one of a running sequence's blocks) holds, if any."""
        block = self.blocks[block_id]
        if block.hash is not None:
            return (block_id, block.generation)
        same = block.same_as
        if same is not None and self.blocks[same[0]].generation == same[1]:
            return same
        return None

    def _orphaned(self, block_id: int) -> bool:
        parent = self.blocks[block_id].parent
        return parent is not None and self.blocks[parent[0]].generation != parent[1]

    def _stored(self, run: list[int], hashes: list[int], start: int) -> None:
        if run:
            self._events.append(BlockStored(tuple(run), hashes[start - 1] if start else None))

    def _uncache(self, block_id: int, *, announce: bool = True) -> None:
        """Take a block out of the prefix cache (its memory stays with whoever references it)."""
        block = self.blocks[block_id]
        assert block.hash is not None
        del self._by_hash[block.hash]
        if announce:
            self._events.append(BlockRemoved((block.hash,)))
        block.hash, block.token_ids, block.parent = None, (), None
        block.generation += 1
        self.uncached += 1
        if block_id in self._evictable:
            del self._evictable[block_id]
            self._free.append(block_id)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._evictable.pop(block_id, None)
        block.ref_count += 1

    def _take(self) -> int:
        if not self._free:
            self._uncache(next(iter(self._evictable)))  # the least recently used, now the only free one
        block_id = self._free.popleft()
        block = self.blocks[block_id]
        block.ref_count, block.same_as = 1, None
        return block_id
