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


def test_a_block_is_reused_only_as_the_child_of_the_block_reused_before_it() -> None:
    """A hit walks a chain: a forged collision in block 1 must not serve K/V computed after another
    block 0."""
    bm = BlockManager(16, BS)
    a = seq([*range(4), *range(10, 14), 1], "a")  # X + Y
    bm.allocate(a)
    compute_all(bm, a)
    w = seq([*range(100, 104), *range(50, 54), 1], "w")  # X' + W: caches X'
    bm.allocate(w)
    compute_all(bm, w)
    b = seq([*range(100, 104), *range(10, 14), 1], "b")  # X' + Y: its block 1 holds A's block 1's tokens
    ha, hb = block_hashes(a.token_ids, BS, SEED), block_hashes(b.token_ids, BS, SEED)
    # Forge the collision: A's block 1 (its K/V computed after X) is filed under B's block-1 hash.
    a1 = bm._by_hash.pop(ha[1])
    bm.blocks[a1].hash = hb[1]
    bm._by_hash[hb[1]] = a1
    assert bm.allocate(b) == BS  # X' is shared; A's block 1 is not, though its hash and tokens match
    assert b.block_table[0] == w.block_table[0] and b.block_table[1] != a1


def test_a_collision_hidden_when_registering_does_not_link_later_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hash that cannot tell X' from X: R (X' + Y) finds X's hash taken and keeps its X' block private;
    its Y block, computed after X', must not then be found by S (X + Y) as the child of X."""
    x, forged, y = [*range(4)], [*range(200, 204)], [*range(10, 14)]

    def colliding(tokens: list[int], block_size: int, seed: int, *, parent: int | None = None) -> list[int]:
        blocks = [tokens[i : i + block_size] for i in range(0, len(tokens), block_size)]
        return block_hashes(
            [t for blk in blocks for t in (x if blk == forged else blk)], block_size, seed, parent=parent
        )

    monkeypatch.setattr("engine.sequence.block_hashes", colliding)  # what Sequence.block_hashes calls
    bm = BlockManager(16, BS)
    c = seq([*x, 1], "c")
    bm.allocate(c)
    compute_all(bm, c)  # X is cached
    r = seq([*forged, *y, 1], "r")
    assert bm.allocate(r) == 0  # X's tokens are compared: no reuse
    compute_all(bm, r)
    s = seq([*x, *y, 1], "s")
    assert bm.allocate(s) == BS  # X only: the cached Y block attended to X', not X
    assert s.block_table[0] == c.block_table[0] and s.block_table[1] != r.block_table[1]


def test_stored_events_name_the_parent_of_their_first_block() -> None:
    """X + Y and X + Z computed side by side: Z's X is a duplicate, not stored again, yet Z's parent is X."""
    bm = BlockManager(16, BS)
    x = [*range(4)]
    a, b = seq([*x, *range(10, 14), 1], "a"), seq([*x, *range(20, 24), 1], "b")
    bm.allocate(a)
    bm.allocate(b)  # nothing is computed yet: b gets blocks of its own
    compute_all(bm, a)
    compute_all(bm, b)
    ha, hb = block_hashes(a.token_ids, BS, SEED), block_hashes(b.token_ids, BS, SEED)
    assert bm.drain_events() == [BlockStored((ha[0], ha[1]), None), BlockStored((hb[1],), hb[0])]
    bm.free(a)
    again = seq([*x, *range(20, 24), 1], "again")
    assert bm.allocate(again) == 2 * BS  # Z is found as X's child, though it was computed after b's own X


def test_a_stored_event_after_a_chunk_names_the_last_block_of_the_chunk_before() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(13)))
    bm.allocate(a)
    a.num_computed = 5  # a first chunk: one full block
    bm.register_full_blocks(a)
    compute_all(bm, a)
    h = block_hashes(a.token_ids, BS, SEED)
    assert bm.drain_events() == [BlockStored((h[0],), None), BlockStored((h[1], h[2]), h[0])]


def test_a_waiting_prompt_is_walked_again_only_when_the_cache_changed() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    compute_all(bm, a)
    w = seq([*range(12), 1], "w")
    assert bm.can_allocate(w)
    walks = bm.prefix_walks
    for _ in range(3):
        assert bm.can_allocate(w)
    assert bm.prefix_walks == walks
    other = seq(list(range(100, 109)), "other")  # caches blocks that are no part of w's prefix
    bm.allocate(other)
    compute_all(bm, other)
    walks = bm.prefix_walks
    assert bm.can_allocate(w) and bm.prefix_walks == walks
    longer = seq(list(range(13)), "longer")  # caches w's third block
    bm.allocate(longer)
    compute_all(bm, longer)
    assert bm.allocate(w) == 3 * BS
    assert w.block_table[:3] == longer.block_table[:3]


def test_a_remembered_match_loses_the_blocks_evicted_since() -> None:
    bm = BlockManager(5, BS)
    a = seq(list(range(9)), "a")
    bm.allocate(a)
    compute_all(bm, a)
    a0 = a.block_table[0]
    bm.free(a)  # 2 cached blocks, unreferenced
    w = seq([*range(8), 1], "w")
    assert bm.can_allocate(w)
    taker = seq(list(range(100, 116)), "taker")  # 4 blocks: the 3 free ones, then a's tail is evicted
    bm.allocate(taker)
    bm.free(taker)
    assert bm.can_allocate(w) and bm.allocate(w) == BS  # a's first block only
    assert w.block_table[0] == a0


def test_a_block_whose_parent_was_evicted_is_replaced_when_computed_again() -> None:
    """b's Z hangs off a's X (b's own X was a duplicate); a's X is evicted while b runs. Z can no longer be
    reached, so the next X + Z computed takes its place."""
    bm = BlockManager(8, BS)
    x, z = [*range(4)], [*range(20, 24)]
    a, b = seq([*x, 1], "a"), seq([*x, *z, 1], "b")
    bm.allocate(a)
    bm.allocate(b)
    compute_all(bm, a)
    compute_all(bm, b)  # b's X stays private; its Z names a's X as parent
    bm.free(a)
    filler = seq(list(range(100, 117)), "filler")  # 5 blocks: the 4 free ones, then a's X is evicted
    bm.allocate(filler)
    bm.free(filler)
    bm.free(b)
    bm.drain_events()
    c = seq([*x, *z, 1], "c")
    assert bm.allocate(c) == 0  # X is gone (b's copy was never cached)
    compute_all(bm, c)
    h = block_hashes(c.token_ids, BS, SEED)
    assert bm.drain_events() == [BlockRemoved((h[1],)), BlockStored((h[0], h[1]), None)]
    again = seq([*x, *z, 1], "again")
    assert bm.allocate(again) == 2 * BS
