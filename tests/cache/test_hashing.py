"""Contract 1: block hashes chain, stop at the first difference, and never cross namespaces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.hashing import (
    PrefixHashMemo,
    block_hashes,
    chain_parent,
    hash_block,
    namespace_seed,
    namespaced_block_hashes,
    token_bytes,
)

tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200)
block_sizes = st.integers(min_value=1, max_value=32)


@given(tokens, tokens, block_sizes)
@settings(max_examples=300)
def test_equal_prefixes_hash_equal_up_to_first_differing_block(a: list[int], b: list[int], bs: int) -> None:
    seed = namespace_seed("m")
    ha, hb = block_hashes(a, bs, seed), block_hashes(b, bs, seed)
    common_tokens = next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    equal_blocks = common_tokens // bs
    assert ha[:equal_blocks] == hb[:equal_blocks]
    # From the first block that differs in content (or exists in only one), every hash differs: chaining.
    for x, y in zip(ha[equal_blocks:], hb[equal_blocks:], strict=False):
        assert x != y


@given(tokens, block_sizes, st.text(max_size=8), st.text(max_size=8))
def test_different_namespaces_give_disjoint_hashes(t: list[int], bs: int, salt_a: str, salt_b: str) -> None:
    if salt_a == salt_b:
        return
    ha = block_hashes(t, bs, namespace_seed("m", salt_a))
    hb = block_hashes(t, bs, namespace_seed("m", salt_b))
    assert not set(ha) & set(hb)


def test_partial_tail_block_is_never_hashed() -> None:
    seed = namespace_seed("m")
    assert len(block_hashes(list(range(47)), 16, seed)) == 2
    assert len(block_hashes(list(range(48)), 16, seed)) == 3
    assert block_hashes(list(range(15)), 16, seed) == []


def test_chain_matches_one_block_at_a_time_and_continues_from_a_parent() -> None:
    seed = namespace_seed("m", "salt")
    ids = list(range(100, 164))
    whole = block_hashes(ids, 16, seed)
    h, manual = seed, []
    for i in range(4):
        h = hash_block(h, token_bytes(ids[i * 16 : (i + 1) * 16]))
        manual.append(h)
    assert manual == whole
    assert block_hashes(ids[32:], 16, seed, parent=whole[1]) == whole[2:]


def test_numpy_and_list_inputs_agree() -> None:
    seed = namespace_seed("m")
    ids = list(range(300))
    expected = block_hashes(ids, 16, seed)
    assert block_hashes(np.asarray(ids, dtype=np.uint32), 16, seed) == expected
    assert block_hashes(np.asarray(ids, dtype=np.int64), 16, seed) == expected


def test_namespace_parts_do_not_run_together() -> None:
    assert namespace_seed("ab", "c") != namespace_seed("a", "bc")
    assert namespace_seed("m", "", "x") != namespace_seed("m", "x", "")


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_invalid_token_ids_are_rejected(bad: list[object]) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad * 16, 16, 0)  # type: ignore[arg-type]


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, 0)


@given(st.lists(tokens, min_size=1, max_size=6), st.integers(1, 8), st.integers(1, 4))
@settings(max_examples=200)
def test_the_memo_always_equals_plain_hashing(prompts: list[list[int]], bs: int, every: int) -> None:
    memo = PrefixHashMemo(every=every, max_segments=5)
    seed = namespace_seed("m")
    base = prompts[0]
    # Conversations: each prompt extends an earlier one, the way chats resend their history.
    for extra in prompts:
        for p in (base, base + extra, extra):
            assert memo.block_hashes(p, bs, seed) == block_hashes(p, bs, seed)
        base = base + extra


def test_the_memo_reuses_a_repeated_prefix() -> None:
    memo = PrefixHashMemo(every=4)
    seed = namespace_seed("m")
    first = list(range(16 * 40))
    memo.block_hashes(first, 16, seed)
    assert memo.hits == 0 and len(memo) == 10
    longer = [*first, *range(5000, 5000 + 16 * 9)]
    assert memo.block_hashes(longer, 16, seed) == block_hashes(longer, 16, seed)
    assert memo.hits == 10  # all 40 known blocks came from the memo
    assert memo.block_hashes(first, 16, namespace_seed("other")) == block_hashes(
        first, 16, namespace_seed("other")
    )
    assert memo.hits == 10  # another namespace shares nothing


# -- tenant namespaces and shared public prefixes ------------------------------------------------------


def test_shared_prefix_blocks_are_public_and_the_rest_private() -> None:
    ids = np.arange(10 * 4, dtype=np.uint32)
    public, acme, globex = namespace_seed("m"), namespace_seed("m", "acme"), namespace_seed("m", "globex")
    a = namespaced_block_hashes(ids, 4, acme, public_seed=public, shared_blocks=3)
    g = namespaced_block_hashes(ids, 4, globex, public_seed=public, shared_blocks=3)
    assert a[:3] == g[:3] == block_hashes(ids[:12], 4, public)  # the declared prefix: one cache for all
    assert not set(a[3:]) & set(g[3:])  # after it, nothing shared between tenants
    assert not set(a[3:]) & set(block_hashes(ids, 4, public))  # ... nor with the public namespace
    # Without a shared part, or without a salt, it is plain block_hashes.
    assert namespaced_block_hashes(ids, 4, acme) == block_hashes(ids, 4, acme)
    assert namespaced_block_hashes(ids, 4, public, public_seed=public, shared_blocks=3) == block_hashes(
        ids, 4, public
    )
    # A chain continues block by block exactly as if hashed whole (the engines extend chains this way).
    head = namespaced_block_hashes(ids[:12], 4, acme, public_seed=public, shared_blocks=3)
    rest = block_hashes(ids[12:], 4, acme, parent=chain_parent(head, 3, acme, public))
    assert head + rest == a
