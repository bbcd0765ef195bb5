"""Translates vLLM/SGLang KV events into kvgate's own (contract 1) block hashes.

Other engines' block hashes cannot be computed by the gateway (vLLM: sha256 over pickled digests with a
per-process seed; SGLang: its own chain), so they are kept only as opaque ids. From each ``BlockStored``'s
``token_ids`` and its parent's kvgate hash the translator computes the kvgate hash of every block, and
remembers engine id -> kvgate hash for later children and removals. The result is a list of
``cache.events`` events the residency index applies like those of kvgate's own engines.

Never index a wrong hash; under-predicting is allowed:

- a block whose parent is unknown (a missed batch, or history from before we listened) is skipped and
  counted; its children are then unknown too;
- a block whose hash depends on more than its tokens and namespace (multimodal inputs, prompt embeddings,
  a LoRA known only by id, non-token pages) is remembered as "known but not indexable", with its
  descendants, so neither is mistaken for a plain-text prefix nor reported as an unknown parent;
- the same engine block may be announced more than once (two requests computing one prefix together get
  two physical copies, each removed on its own): references are counted, and a block leaves the index
  when no copy is left, on any data-parallel rank of the engine.

Routing blocks: an engine with tiny blocks (SGLang's pages of 1 token) is routed in blocks of several of its
own (``routing_block``), so that a prompt costs the gateway one hash and one lookup step per routing block,
not per token. A routing block's kvgate hash chains its k pages' tokens on the previous routing block's hash
(exactly ``block_hashes(prompt, routing_block, seed)``); it enters the index when the engine block that
completes it is stored and leaves when that block is removed. The pages before it in its group are known
(children resolve through them) but index nothing. That is exact because vLLM and SGLang evict a chain tail
first: a group's earlier pages outlive its last one, so a routing block is held while its last page is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from cache.foreign_events import (
    EngineHash,
    ForeignCleared,
    ForeignEvent,
    ForeignRemoved,
    ForeignStored,
)
from cache.hashing import block_hashes, cached_namespace_seed, hash_block, token_bytes

GPU = "gpu"


def routing_block(block_size: int, min_block_size: int) -> int:
    """The block a vLLM/SGLang engine is routed in: its own when that is at least ``min_block_size`` tokens,
    else the smallest whole number of its blocks that is (SGLang's page of 1, a minimum of 16: 16). Whole
    pages, so that a routing block's hash follows from the engine's events; coarser blocks only round the
    gateway's predictions down (a routing block counts as cached when all its pages are)."""
    if block_size >= min_block_size:
        return block_size
    return -(-min_block_size // block_size) * block_size


@dataclass(slots=True)
class _Entry:
    khash: int | None  # the kvgate hash it indexes; None: known to the engine but never indexed (module doc)
    refs: int  # copies the engine announced and has not removed yet


@dataclass(slots=True)
class _PageEntry(_Entry):
    """An engine block where a routing block spans several: also where the chain stands after it. Only the
    page completing a routing block has a ``khash``; the others are kept for their children."""

    start: int | None  # what the next routing block chains on (seed or last routing hash); None: unindexable
    pending: bytes  # token bytes of its group's pages up to and including it; b"" where a group completes
    first: bool  # in the chain's first routing block: the hash completing it has no parent in the index


class ForeignChain:
    """One engine's engine-hash -> kvgate-hash map, per data-parallel rank, with engine-wide counts.

    ``model`` names the namespace of blocks without a LoRA (the name clients send as ``model``); a LoRA's
    blocks live in the namespace of its name, which is what a client sends as ``model`` to reach it.
    ``block_size``, when known, is the engine's own block (page) size: blocks of any other size (vLLM's
    partial prefix entries, SGLang's short last page) are never indexed. ``routing_block``, a multiple of
    it (default: the same), is the size the gateway hashes this engine's prompts with (module doc).
    """

    def __init__(
        self, model: str, *, block_size: int | None = None, routing_block: int | None = None
    ) -> None:
        if routing_block is not None and (not block_size or routing_block < 1 or routing_block % block_size):
            raise ValueError(f"routing_block {routing_block} must be a multiple of block_size {block_size}")
        self.model = model
        self.block_size = block_size
        # Fixed for the chain's life: entries of a grouped chain carry state a plain one's do not.
        self._pages = routing_block // block_size if routing_block and block_size else 1
        self._ranks: dict[int, dict[EngineHash, _Entry]] = {}
        self._held: dict[int, int] = {}  # kvgate hash -> copies across all ranks
        self.unknown_parent_blocks = 0  # skipped: parent never seen (missed batch or older history)
        self.unindexable_blocks = 0  # known, never indexed: multimodal, embeddings, odd block size, ...
        self.ignored_blocks = 0  # events of another medium (CPU, disk) or KV cache group

    # -- reading ---------------------------------------------------------------------------------------

    @property
    def routing_block(self) -> int | None:
        """Tokens per block of the kvgate chain it computes (None: each event's own block size)."""
        return None if self.block_size is None else self.block_size * self._pages

    def held(self) -> list[int]:
        """Every kvgate hash some rank of the engine holds: what a resync of the engine sets."""
        return list(self._held)

    def holds(self, khash: int) -> bool:
        return khash in self._held

    def known(self, engine_hash: EngineHash, rank: int = 0) -> bool:
        return engine_hash in self._ranks.get(rank, {})

    def kvgate_hash(self, engine_hash: EngineHash, rank: int = 0) -> int | None:
        entry = self._ranks.get(rank, {}).get(engine_hash)
        return None if entry is None else entry.khash

    def __len__(self) -> int:
        """Engine blocks known, over all ranks."""
        return sum(map(len, self._ranks.values()))

    # -- writing ---------------------------------------------------------------------------------------

    def reset_rank(self, rank: int) -> None:
        """Forget what ``rank`` holds (it restarted, or we lost track of it); other ranks keep theirs."""
        self._drop_rank(rank)

    def apply(self, events: Iterable[ForeignEvent], rank: int = 0) -> list[KvEvent]:
        """Take one batch of ``rank``'s events; return what changes in the index, in order."""
        out: list[KvEvent] = []
        blocks = self._ranks.setdefault(rank, {})
        for event in events:
            if isinstance(event, ForeignStored):
                stored = self._stored(blocks, event)
                if stored is not None:
                    out.append(stored)
            elif isinstance(event, ForeignRemoved):
                removed = self._removed(blocks, event)
                if removed:
                    out.append(BlockRemoved(tuple(removed)))
            elif isinstance(event, ForeignCleared):
                dropped = self._drop_rank(rank)
                blocks = self._ranks.setdefault(rank, {})
                # With no other rank holding anything, one cheap "cleared" says it all.
                if not self._held:
                    out.append(AllCleared())
                elif dropped:
                    out.append(BlockRemoved(tuple(dropped)))
        return out

    def _drop_rank(self, rank: int) -> list[int]:
        blocks = self._ranks.pop(rank, {})
        dropped = []
        for entry in blocks.values():
            if entry.khash is not None and self._release(entry.khash, entry.refs):
                dropped.append(entry.khash)
        return dropped

    def _release(self, khash: int, copies: int) -> bool:
        """Count ``copies`` of ``khash`` gone; returns whether the index loses it (no copy left anywhere)."""
        left = self._held[khash] - copies
        if left > 0:
            self._held[khash] = left
            return False
        del self._held[khash]
        return True

    def _stored(self, blocks: dict[EngineHash, _Entry], event: ForeignStored) -> BlockStored | None:
        n = len(event.block_hashes)
        if not _relevant(event.medium, event.group_idx):
            # The index says which prefixes a request finds in GPU memory, ready to use. vLLM's CPU and
            # disk tiers (and SGLang's host cache) announce their copies with another medium: those must
            # be loaded back first, and are announced as GPU blocks when they are. Other KV cache groups
            # (sliding-window or Mamba layers of hybrid models) hold the same positions under their own
            # ids; group 0 alone describes the prefix.
            self.ignored_blocks += n
            return None
        parent_entry: _Entry | None = None
        if event.parent is not None:
            parent_entry = blocks.get(event.parent)
            if parent_entry is None:
                self.unknown_parent_blocks += n
                return None
        if self._pages > 1:
            return self._stored_in_groups(blocks, event, parent_entry)
        parent_k = None if parent_entry is None else parent_entry.khash
        parent_ok = parent_entry is None or parent_k is not None
        khashes = self._kvgate_hashes(event, parent_k) if parent_ok else []
        self.unindexable_blocks += n - len(khashes)
        new: list[int] = []
        new_parent: int | None = None
        prev = parent_k
        for i, engine_hash in enumerate(event.block_hashes):
            k, gained = self._announce(
                blocks, engine_hash, _Entry(khashes[i] if i < len(khashes) else None, 1)
            )
            if gained and k is not None:
                if not new:
                    new_parent = prev
                new.append(k)
            prev = k
        return BlockStored(tuple(new), new_parent) if new else None

    def _stored_in_groups(
        self, blocks: dict[EngineHash, _Entry], event: ForeignStored, parent: _Entry | None
    ) -> BlockStored | None:
        """``_stored`` where a routing block spans several engine blocks: the chain goes on from the state
        the parent page left (a group may start in one event and complete in a later one)."""
        n = len(event.block_hashes)
        start: int | None = None
        pending = b""
        first = True
        if parent is not None:
            assert isinstance(parent, _PageEntry), "a grouped chain holds page entries only"
            start, pending, first = parent.start, parent.pending, parent.first
        data = b""
        page = 0
        if parent is None or start is not None:
            found = self._hashable(event, start)
            if found is not None:
                start, tokens, size = found
                try:
                    data = token_bytes(tokens)
                except ValueError:  # token ids the hash cannot take (the decoder checked them)
                    data = b""
                page = size * 4  # uint32 per token
        usable = len(data) // page if page else 0
        self.unindexable_blocks += n - usable
        group = page * self._pages
        new: list[int] = []
        new_parent: int | None = None
        prev = None if first else start  # the chain's last routing hash so far
        for i, engine_hash in enumerate(event.block_hashes):
            k: int | None = None
            if i < usable and start is not None:
                pending += data[i * page : (i + 1) * page]
                if len(pending) == group:
                    k = start = hash_block(start, pending)
                    pending = b""
                    first = False
                entry_state: tuple[int | None, bytes, bool] = (start, pending, first)
            else:
                entry_state = (None, b"", False)
            k, gained = self._announce(blocks, engine_hash, _PageEntry(k, 1, *entry_state))
            if gained and k is not None:
                if not new:
                    new_parent = prev
                new.append(k)
            if k is not None:
                prev = k
        return BlockStored(tuple(new), new_parent) if new else None

    def _announce(
        self, blocks: dict[EngineHash, _Entry], engine_hash: EngineHash, if_new: _Entry
    ) -> tuple[int | None, bool]:
        """Count one announced copy of ``engine_hash`` (``if_new`` when it is the first); returns its kvgate
        hash and whether the index gains that hash (no copy of it was held on any rank)."""
        entry = blocks.get(engine_hash)
        if entry is None:
            blocks[engine_hash] = entry = if_new
        else:
            entry.refs += 1  # the first announcement named it; a second copy is the same block
        k = entry.khash
        if k is None:
            return None, False
        count = self._held.get(k, 0)
        self._held[k] = count + 1
        return k, count == 0

    def _removed(self, blocks: dict[EngineHash, _Entry], event: ForeignRemoved) -> list[int]:
        if not _relevant(event.medium, event.group_idx):
            return []
        dropped = []
        for engine_hash in event.block_hashes:
            entry = blocks.get(engine_hash)
            if entry is None:
                continue  # never announced to us (before we listened, or parent unknown): nothing to undo
            entry.refs -= 1
            if entry.refs <= 0:
                del blocks[engine_hash]
            if entry.khash is not None and self._release(entry.khash, 1):
                dropped.append(entry.khash)
        return dropped

    def _kvgate_hashes(self, event: ForeignStored, parent_k: int | None) -> list[int]:
        """The kvgate hashes of the event's leading indexable blocks (all of them, normally)."""
        found = self._hashable(event, parent_k)
        if found is None:
            return []
        start, tokens, size = found
        try:
            return block_hashes(tokens, size, start, parent=start)
        except ValueError:  # token ids the hash cannot take (the decoder checked them; belt and braces)
            return []

    def _hashable(self, event: ForeignStored, parent_k: int | None) -> tuple[int, Sequence[int], int] | None:
        """(what the event's first block chains on, the tokens of its leading indexable blocks, their block
        size), or None where no block of it can be indexed. ``parent_k`` None: the event starts a chain."""
        n = len(event.block_hashes)
        size = event.block_size
        tokens = event.token_ids
        if tokens is None or size <= 0 or len(tokens) != size * n:
            return None
        if self.block_size is not None and size != self.block_size:
            return None
        if event.lora_id is not None and event.lora_name is None:
            return None  # a LoRA known by id only: its namespace (the name clients use) is unknown
        salt, usable = _read_extra_keys(event, root=event.parent is None)
        if usable == 0:
            return None
        # A chain's root continues from its namespace's seed, as the gateway's hash of a prompt does.
        start = cached_namespace_seed(event.lora_name or self.model, salt) if parent_k is None else parent_k
        if usable < n:
            tokens = tokens[: usable * size]
        return start, tokens, size


def _relevant(medium: str | None, group_idx: int | None) -> bool:
    return (medium is None or medium.lower() == GPU) and not group_idx


def _read_extra_keys(event: ForeignStored, *, root: bool) -> tuple[str, int]:
    """(the chain's cache salt, how many leading blocks hash from tokens and namespace alone).

    vLLM publishes each block's extra keys untagged, in this order: the LoRA name (on every block of a
    LoRA request), multimodal ``(identifier, offset)`` pairs (older versions: bare identifier strings),
    the cache salt (a string, on the block at token 0 only), prompt-embedding digests (bytes). A salt is
    the one string left on a first block once the LoRA name is set aside; anything else makes the block,
    and every block after it, depend on more than its tokens. (An older vLLM's bare image identifier
    alone on a first block reads as a salt: that only puts the chain in a namespace no request uses.)
    """
    n = len(event.block_hashes)
    salt = event.cache_salt or ""
    keys = event.extra_keys
    if not keys:
        return salt, n
    lora = event.lora_name
    for i in range(min(n, len(keys))):
        entry = keys[i]
        if not entry:
            continue
        items = list(entry)
        if lora is not None and items and items[0] == lora:
            items = items[1:]
        if not items:
            continue
        if root and i == 0 and len(items) == 1 and isinstance(items[0], str):
            salt = items[0]
            continue
        return salt, i
    return salt, n
