"""The simulator's prefix cache: matching, LRU eviction (tail first), pinning, and the KV events it emits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.events import BlockRemoved, BlockStored, KvEvent
from engine.sim.prefix_cache import PrefixCache


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[KvEvent]] = []

    def __call__(self, events: list[KvEvent]) -> None:
        self.calls.append(events)

    def take(self) -> list[KvEvent]:
        out = [e for call in self.calls for e in call]
        self.calls.clear()
        return out


def make(capacity: int) -> tuple[PrefixCache, Recorder]:
    rec = Recorder()
    return PrefixCache(capacity, on_events=rec), rec


def test_match_counts_leading_cached_blocks() -> None:
    cache, _ = make(16)
    assert cache.store([1, 2, 3]) == 3
    assert cache.match([1, 2, 3]) == 3
    assert cache.match([1, 2, 9, 3]) == 2
    assert cache.match([9, 1]) == 0
    assert cache.match([]) == 0
    assert (len(cache), cache.used, cache.free) == (3, 3, 13)


def test_store_emits_stored_with_parent_chaining() -> None:
    cache, rec = make(16)
    cache.store([1, 2, 3])
    assert rec.take() == [BlockStored((1, 2, 3), None)]
    # Extending the chain reports only the new blocks, chained on the last cached one.
    assert cache.store([1, 2, 3, 4, 5]) == 2
    assert rec.take() == [BlockStored((4, 5), 3)]
    # Nothing new: no event at all.
    assert cache.store([1, 2]) == 0
    assert rec.calls == []
    # An explicit parent continues a chain whose head is elsewhere.
    cache.store([7, 8], parent=5)
    assert rec.take() == [BlockStored((7, 8), 5)]


def test_lru_evicts_oldest_chain_tail_first() -> None:
    cache, rec = make(4)
    cache.store([11, 12])
    cache.store([21, 22])
    # Within a chain the tail is the older entry, so a prefix never loses its middle.
    assert cache.lru_order() == [12, 11, 22, 21]
    rec.take()
    assert cache.store([31]) == 1
    assert rec.take() == [BlockRemoved((12,)), BlockStored((31,), None)]
    assert cache.match([11, 12]) == 1
    cache.store([32], parent=31)
    assert rec.take() == [BlockRemoved((11,)), BlockStored((32,), 31)]
    assert cache.match([21, 22]) == 2


def test_store_refreshes_recency_but_match_does_not() -> None:
    cache, _ = make(4)
    cache.store([11, 12])
    cache.store([21, 22])
    cache.match([11, 12])  # a probe
    assert cache.lru_order()[:2] == [12, 11]
    cache.store([11, 12])  # a use
    assert cache.lru_order() == [22, 21, 12, 11]


def test_release_makes_blocks_most_recent() -> None:
    cache, _ = make(4)
    cache.store([11, 12])
    cache.store([21, 22])
    pinned = cache.acquire([11, 12])
    assert pinned == [11, 12]
    assert cache.pinned == 2
    assert cache.lru_order() == [22, 21]
    cache.release(pinned)
    assert cache.pinned == 0
    assert cache.lru_order() == [22, 21, 12, 11]


def test_pinned_blocks_are_never_evicted() -> None:
    cache, rec = make(3)
    cache.store([1, 2, 3])
    pinned = cache.acquire([1, 2, 3])
    rec.take()
    # Full and nothing evictable: the new block is simply not cached, and nothing is reported.
    assert cache.store([9]) == 0
    assert rec.calls == []
    assert cache.match([1, 2, 3]) == 3
    assert 9 not in cache
    cache.release(pinned)
    assert cache.store([9]) == 1
    assert rec.take() == [BlockRemoved((3,)), BlockStored((9,), None)]


def test_refcounts_add_up() -> None:
    cache, _ = make(4)
    cache.store([1, 2])
    a = cache.acquire([1, 2])
    b = cache.acquire([1])
    assert (cache.refcount(1), cache.refcount(2)) == (2, 1)
    cache.release(a)
    assert (cache.refcount(1), cache.refcount(2)) == (1, 0)
    assert cache.lru_order() == [2]
    cache.release(b)
    assert cache.pinned == 0


def test_acquire_skips_uncached_and_release_rejects_unpinned() -> None:
    cache, _ = make(4)
    cache.store([1, 2])
    assert cache.acquire([1, 5, 2]) == [1, 2]
    with pytest.raises(ValueError, match="not pinned"):
        cache.release([1, 2, 2])
    # The failed call changed nothing.
    assert (cache.refcount(1), cache.refcount(2)) == (1, 1)
    cache.release([1, 2])
    with pytest.raises(ValueError):
        cache.release([1])


def test_store_stops_when_nothing_can_be_evicted() -> None:
    cache, rec = make(3)
    cache.store([1, 2])
    cache.acquire([1, 2])
    rec.take()
    # One free slot: the chain's head fits, its tail cannot evict the head nor the pinned blocks.
    assert cache.store([31, 32, 33]) == 1
    assert rec.take() == [BlockStored((31,), None)]
    assert cache.match([31, 32, 33]) == 1


def test_a_chain_never_evicts_its_own_blocks() -> None:
    cache, rec = make(3)
    cache.store([1, 2, 3])
    rec.take()
    assert cache.store([1, 2, 3, 4]) == 0
    assert rec.calls == []
    assert cache.match([1, 2, 3]) == 3


def test_one_store_evicting_several_blocks_reports_them_together() -> None:
    cache, rec = make(4)
    cache.store([1, 2, 3, 4])
    rec.take()
    cache.store([5, 6, 7])
    assert rec.take() == [BlockRemoved((4, 3, 2)), BlockStored((5, 6, 7), None)]
    assert cache.match([1]) == 1


def test_discard_removes_a_chains_unpinned_tail_up_to_its_first_pinned_block() -> None:
    cache, rec = make(16)
    cache.store([1, 2, 3, 4, 5])
    held = cache.acquire([1, 2])  # another request matched the chain's first two blocks
    rec.take()
    cache.discard([3, 4, 5, 9])  # 9 was never cached: skipped
    assert cache.match([1, 2, 3]) == 2 and len(cache) == 2
    assert rec.take() == [BlockRemoved((5, 4, 3))]
    cache.discard([1, 2])  # pinned: they stay, and nothing is reported
    assert len(cache) == 2 and rec.take() == []
    cache.release(held)
    cache.discard([1, 2])
    assert len(cache) == 0 and cache.lru_order() == [] and rec.take() == [BlockRemoved((2, 1))]


def test_blocks_being_computed_are_matched_but_not_counted_as_computed() -> None:
    cache, _ = make(16)
    cache.store([1, 2, 3, 4])
    cache.computing([3, 4])  # a queued prompt's new blocks
    cache.computing([4])  # and a second prompt computing the last one too
    assert cache.match([1, 2, 3, 4]) == 4 and cache.match_computed([1, 2, 3, 4]) == 2
    cache.computed([3, 4])
    assert cache.match_computed([1, 2, 3, 4]) == 3  # block 4 waits for the second prompt
    cache.computed([4])
    assert cache.match_computed([1, 2, 3, 4, 5]) == 4


def test_zero_capacity_caches_nothing() -> None:
    cache, rec = make(0)
    assert cache.store([1, 2]) == 0
    assert cache.match([1]) == 0
    assert rec.calls == []
    assert cache.free == 0


def test_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError):
        PrefixCache(-1)


# A chain universe small enough for collisions: chain c, block i is hash c * 100 + i.
_ops = st.lists(
    st.tuples(st.sampled_from(["store", "acquire", "release"]), st.integers(0, 4), st.integers(1, 6)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 12), ops=_ops)
def test_invariants_under_random_operations(capacity: int, ops: list[tuple[str, int, int]]) -> None:
    rec = Recorder()
    cache = PrefixCache(capacity, on_events=rec)
    held: list[list[int]] = []
    replay: set[int] = set()
    for op, chain, length in ops:
        hashes = [chain * 100 + i for i in range(length)]
        if op == "store":
            cache.store(hashes)
        elif op == "acquire":
            held.append(cache.acquire(hashes))
        elif held:
            cache.release(held.pop(0))
        for event in rec.take():
            if isinstance(event, BlockStored):
                # A stored run always hangs on a cached parent (or starts a chain).
                assert event.parent is None or event.parent in replay or event.parent in cache
                replay.update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert all(cache.refcount(h) == 0 for h in event.block_hashes)
                replay.difference_update(event.block_hashes)
        assert len(cache) <= capacity
        # The events describe the cache exactly, and the LRU holds exactly the unpinned blocks.
        assert replay == {h for c in range(5) for h in range(c * 100, c * 100 + 6) if h in cache}
        assert set(cache.lru_order()) == {h for h in replay if cache.refcount(h) == 0}
        # Every cached block's parent is cached too: prefixes never lose their middle.
        assert all(h % 100 == 0 or h - 1 in cache for h in replay)
    for pins in held:
        cache.release(pins)
    assert cache.pinned == 0
