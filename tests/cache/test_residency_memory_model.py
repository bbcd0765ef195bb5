"""The in-process residency index against a plain model of what it must answer, on random operations:
exact and approximate adds (with expiries), removals and clears by several engines, and lookups between
them, over prompts that share prefixes, with holes, duplicates and engines holding more or less than one
another. Prompts are chains, as the contract's hashes are (a block names its whole prefix): paths down a
fixed tree of blocks. The index remembers the depths its walks verified (every ``checkpoint_blocks``); the
lookups between operations check that a removal forgets them."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cache.residency_memory import MemoryResidencyIndex

ENGINES = ["a", "b", "c", "d"]
BLOCKS = list(range(1, 13))  # small enough that prompts overlap and collide often
# The tree the prompts walk down: block -> its parent (1 is the root: everyone's system prompt).
PARENT = {2: 1, 3: 2, 4: 3, 5: 4, 6: 5, 7: 3, 8: 7, 9: 8, 10: 1, 11: 10, 12: 11}


def path_to(block: int) -> list[int]:
    """The prompt whose last block is ``block``: the chain from the root down to it."""
    path = [block]
    while path[-1] in PARENT:
        path.append(PARENT[path[-1]])
    return path[::-1]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.sampled_from(ENGINES), st.lists(st.sampled_from(BLOCKS), max_size=10)),
        st.tuples(
            st.just("approx"),
            st.sampled_from(ENGINES),
            st.lists(st.sampled_from(BLOCKS), max_size=6),
            st.sampled_from([1.0, 5.0]),
        ),
        st.tuples(st.just("remove"), st.sampled_from(ENGINES), st.lists(st.sampled_from(BLOCKS), max_size=6)),
        st.tuples(st.just("clear"), st.sampled_from(ENGINES)),
        st.tuples(st.just("tick"), st.sampled_from([0.5, 2.0])),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(operations=ops, step=st.sampled_from([1, 2, 16]))
@example(operations=[("add", "a", [1, 2, 3]), ("remove", "a", [2])], step=1)  # a hole in a verified prefix
@example(operations=[("add", "a", [1, 2, 3]), ("clear", "a"), ("add", "a", [1])], step=1)  # cleared since
def test_lookups_match_a_plain_model(operations: list[tuple[Any, ...]], step: int) -> None:
    """Every prompt (every path down the tree) is looked up after every operation."""
    now = [0.0]
    index = MemoryResidencyIndex(clock=lambda: now[0], checkpoint_blocks=step)
    exact: dict[str, set[int]] = {e: set() for e in ENGINES}
    approx: dict[str, dict[int, float]] = {e: {} for e in ENGINES}

    def check(prompt: list[int]) -> None:
        expected = {}
        for e in ENGINES:
            depth = 0
            while depth < len(prompt) and (
                prompt[depth] in exact[e] or approx[e].get(prompt[depth], 0.0) > now[0]
            ):
                depth += 1
            if depth:
                expected[e] = depth
        assert index.lookup(prompt) == expected

    for op in operations:
        if op[0] == "add":
            _, e, hs = op
            index.add_now(e, hs)
            exact[e].update(hs)
            for h in hs:
                approx[e].pop(h, None)
        elif op[0] == "approx":
            _, e, hs, ttl = op
            index.add_now(e, hs, ttl)
            for h in hs:
                if h not in exact[e]:
                    approx[e][h] = max(approx[e].get(h, 0.0), now[0] + ttl)
        elif op[0] == "remove":
            _, e, hs = op
            index.remove_now(e, hs)
            exact[e].difference_update(hs)
            for h in hs:
                approx[e].pop(h, None)
        elif op[0] == "clear":
            index.clear_now(op[1])
            exact[op[1]].clear()
            approx[op[1]].clear()
        else:
            now[0] += op[1]
        for block in BLOCKS:
            check(path_to(block))
    assert len(index) == sum(map(len, exact.values())) + sum(len(a) for a in approx.values())
