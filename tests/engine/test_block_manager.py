"""The paged KV-cache bookkeeping: allocation, sharing, prefix cache, eviction order, KV events."""

from __future__ import annotations

import pytest

from cache.events import BlockRemoved, BlockStored
from cache.hashing import block_hashes, namespace_seed
from engine.block_manager import BlockManager
from engine.sequence import SamplingParams, Sequence

BS = 4
SEED = namespace_seed("m")


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), SEED)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """Pretend the model computed every token of ``s`` (what the engine does after a step)."""
    s.num_computed = s.num_tokens
    bm.register_full_blocks(s)


def test_a_shared_prefix_is_reused_and_reported() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(14)))  # 3 full blocks + 2 tokens
    assert bm.can_allocate(a) and bm.allocate(a) == 0
    assert len(a.block_table) == 4
    compute_all(bm, a)
    events = bm.drain_events()
    expected = block_hashes(a.token_ids, BS, SEED)
    assert events == [BlockStored(tuple(expected), None)]

    b = seq([*range(12), 99, 98, 97], "b")  # same first 3 blocks
    assert bm.allocate(b) == 3 * BS
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] not in a.block_table
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])


def test_at_least_one_token_is_left_to_compute() -> None:
    bm = BlockManager(8, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    bm.free(a)
    again = seq(list(range(8)), "again")
    assert bm.allocate(again) == BS  # the last block is recomputed: its step yields the next token
    assert again.num_computed == BS


def test_token_ids_are_compared_on_a_hash_hit() -> None:
    bm = BlockManager(8, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    # Forge a collision: the cached block claims the hash of different tokens.
    bm.blocks[a.block_table[0]].token_ids = (7, 7, 7, 7)
    b = seq([*range(8), 1], "b")
    assert bm.allocate(b) == 0


def test_unreferenced_blocks_stay_cached_and_go_least_recently_used_first() -> None:
    bm = BlockManager(4, BS)
    a, b = seq(list(range(8)), "a"), seq(list(range(100, 108)), "b")
    for s in (a, b):
        bm.allocate(s)
        compute_all(bm, s)
        bm.free(s)
    bm.drain_events()
    assert bm.num_free == 4 and bm.num_cached == 4
    c = seq([*range(200, 204), 1], "c")  # needs 2 fresh blocks: a's, the older, go first
    bm.allocate(c)
    events = bm.drain_events()
    ha = block_hashes(a.token_ids, BS, SEED)
    # a's tail block is evicted before its head: no cached block is ever left without its parent.
    assert events == [BlockRemoved((ha[1],)), BlockRemoved((ha[0],))]
    bm.free(c)
    b2 = seq([*range(100, 108), 5], "b2")
    assert bm.can_allocate(b2)
    assert bm.allocate(b2) == 2 * BS  # b survived


def test_demoted_blocks_are_evicted_first_tail_first_and_silently() -> None:
    bm = BlockManager(7, BS)
    a, b = seq(list(range(8)), "a"), seq(list(range(100, 112)), "b")
    for s in (a, b):  # a is the least recently used: it would go first
        bm.allocate(s)
        compute_all(bm, s)
        bm.free(s)
    bm.drain_events()
    pinned = seq([*range(100, 104), 7], "pinned")
    bm.allocate(pinned)  # a running sequence shares b's first block: demoting must not touch it
    b_blocks = [bm._by_hash[h] for h in block_hashes(b.token_ids, BS, SEED)]
    bm.demote(b_blocks)  # a peer pulled all of b
    assert bm.drain_events() == []  # still cached: nothing to tell the gateway
    assert list(bm._evictable)[:2] == [b_blocks[2], b_blocks[1]]
    c = seq([*range(200, 208), 1], "c")  # 3 blocks: the free one, then b's tail before its middle
    bm.allocate(c)
    hb = block_hashes(b.token_ids, BS, SEED)
    assert bm.drain_events() == [BlockRemoved((hb[2],)), BlockRemoved((hb[1],))]
    again = seq([*range(8), 1], "again")
    assert len(bm.match_prefix(again)) == 2  # a, older but never pulled, survived
    assert bm.blocks[b_blocks[0]].hash == hb[0]  # the shared block was never evictable


def test_referenced_blocks_are_never_evicted() -> None:
    bm = BlockManager(3, BS)
    a = seq(list(range(8)))
    bm.allocate(a)
    compute_all(bm, a)
    other = seq(list(range(50, 59)), "o")  # 3 blocks needed, 1 free
    assert not bm.can_allocate(other)
    bm.free(a)
    assert bm.can_allocate(other)


def test_growing_for_decode_and_freeing_everything() -> None:
    bm = BlockManager(4, BS)
    a = seq(list(range(4)))
    bm.allocate(a)
    assert len(a.block_table) == 1
    assert bm.can_grow(a, 9)
    bm.grow(a, 9)
    assert len(a.block_table) == 3
    assert not bm.can_grow(a, 17)
    bm.free(a)
    assert bm.num_free == 4 and a.block_table == []


def test_an_identical_block_computed_twice_is_not_registered_twice() -> None:
    bm = BlockManager(8, BS)
    a, b = seq(list(range(9)), "a"), seq(list(range(9)), "b")
    bm.allocate(a)
    bm.allocate(b)  # a has computed nothing yet: b gets blocks of its own
    compute_all(bm, a)
    compute_all(bm, b)
    stored = [h for e in bm.drain_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert len(stored) == len(set(stored)) == 2
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 8


@pytest.mark.parametrize("bad", [(0, 4), (4, 0)])
def test_bad_sizes_are_refused(bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        BlockManager(*bad)
