"""Blocks "held soon": a routing decision's mark on an engine until its KV events confirm the blocks."""

from __future__ import annotations

from cache.residency_memory import MemoryResidencyIndex


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_blocks_held_soon_count_until_confirmed_forgotten_or_expired() -> None:
    clock = Clock()
    index = MemoryResidencyIndex(clock=clock)
    index.add_now("e0", [1, 2])
    index.hold_soon_now("e0", [3, 4, 5], ttl_s=30.0)
    index.hold_soon_now("e1", [1, 2, 3], ttl_s=30.0)
    assert index.lookup([1, 2, 3, 4, 5, 6]) == {"e0": 5, "e1": 3}
    # What a peer could give: only what the events said.
    assert index.lookup_confirmed([1, 2, 3, 4, 5, 6])[1] == {"e0": 2}
    index.add_now("e0", [3, 4])  # the events confirm part of it
    assert index.held_soon_now("e0") == {5} and index.lookup([1, 2, 3, 4, 5]) == {"e0": 5, "e1": 3}
    index.forget_soon_now("e1", [1, 2, 3])  # e1 never took its request
    assert index.lookup([1, 2, 3]) == {"e0": 3}
    clock.now = 31.0
    index.sweep_now()  # e0's last block was never confirmed in time
    assert index.held_soon_now("e0") == frozenset() and index.lookup([1, 2, 3, 4, 5]) == {"e0": 4}


def test_a_walk_runs_through_exact_held_soon_and_approximate_blocks_alike() -> None:
    index = MemoryResidencyIndex(clock=lambda: 0.0)
    index.add_now("e0", [1, 2, 5])
    index.hold_soon_now("e0", [3, 4, 7], ttl_s=30.0)
    index.add_now("e0", [6], ttl_s=10.0)  # approximate (an event-less record)
    assert index.lookup([1, 2, 3, 4, 5, 6, 7, 8]) == {"e0": 7}
    assert index.lookup([3, 4, 5]) == {"e0": 3}  # a prompt whose first block is only held soon
    index.remove_now("e0", [4])  # an eviction event also ends a mark
    assert index.lookup([1, 2, 3, 4, 5]) == {"e0": 3}
    index.clear_now("e0")
    assert index.lookup([1, 2, 3]) == {}


def test_one_walk_says_what_is_held_and_what_the_events_confirmed() -> None:
    index = MemoryResidencyIndex(clock=lambda: 0.0)
    index.add_now("e0", [1, 2, 3])
    index.hold_soon_now("e0", [4, 5], ttl_s=30.0)
    index.add_now("e1", [1], ttl_s=10.0)  # approximate from the first block
    index.add_now("e1", [2, 3, 4])
    held, confirmed = index.lookup_confirmed([1, 2, 3, 4, 5, 6])
    assert held == {"e0": 5, "e1": 4} and confirmed == {"e0": 3}
    events_only = MemoryResidencyIndex(clock=lambda: 0.0)  # what the KV events alone said
    events_only.add_now("e0", [1, 2, 3])
    events_only.add_now("e1", [2, 3, 4])
    assert confirmed == events_only.lookup([1, 2, 3, 4, 5, 6])


def test_marks_held_soon_are_bounded_the_first_to_expire_going_first() -> None:
    """A flood of long new prompts (or prompts the engines refuse, never confirmed) cannot grow the marks
    without bound."""
    index = MemoryResidencyIndex(clock=lambda: 0.0, max_soon_blocks=6)
    index.hold_soon_now("e0", [1, 2, 3], ttl_s=30.0)
    index.hold_soon_now("e1", [4, 5, 6], ttl_s=30.0)
    assert index.held_soon_now("e0") == {1, 2, 3} and index.held_soon_now("e1") == {4, 5, 6}
    index.hold_soon_now("e1", [7, 8], ttl_s=30.0)  # 8 blocks marked: the oldest mark goes
    assert index.held_soon_now("e0") == frozenset() and index.held_soon_now("e1") == {4, 5, 6, 7, 8}
