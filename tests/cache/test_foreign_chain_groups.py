"""Routing blocks of several engine pages: SGLang's 1-token pages (and pages of 4) translated into the
16-token blocks the gateway hashes prompts in, never a wrong hash, through chunked stores, branches,
tail-first evictions, duplicate copies, unknown parents, unindexable pages, ranks and clears."""

from __future__ import annotations

import random
from typing import Any

import pytest

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEvent
from cache.foreign_chain import ForeignChain, routing_block
from cache.foreign_events import ForeignCleared, ForeignRemoved, ForeignStored
from cache.hashing import block_hashes, namespace_seed
from tests.third_party_engines import sglang_block_digests, sglang_hash_id

MODEL = "m"
ROUTING = 16


def kv(prompt: list[int], *, salt: str = "") -> list[int]:
    """What the gateway hashes the prompt to for this engine: contract 1 in routing blocks."""
    return block_hashes(prompt, ROUTING, namespace_seed(MODEL, salt))


def page_ids(prompt: list[int], page: int) -> list[int]:
    """SGLang's ids of the prompt's full pages (a chained sha256; opaque to the gateway)."""
    return [sglang_hash_id(d) for d in sglang_block_digests(prompt, page)]


def store(ids: list[int], prompt: list[int], first: int, last: int, page: int, **kw: Any) -> ForeignStored:
    """Pages ``first`` up to (not including) ``last`` of ``prompt``, chained on page ``first - 1``."""
    parent = ids[first - 1] if first else None
    return ForeignStored(tuple(ids[first:last]), parent, prompt[first * page : last * page], page, **kw)


def stored_hashes(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]


def removed_hashes(events: list[KvEvent]) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]


def prompt_of(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def test_routing_block_is_the_smallest_whole_number_of_pages_of_at_least_the_minimum() -> None:
    assert [routing_block(b, 16) for b in (1, 3, 4, 5, 16, 32)] == [16, 18, 16, 20, 16, 32]
    with pytest.raises(ValueError):
        ForeignChain(MODEL, block_size=4, routing_block=18)
    with pytest.raises(ValueError):
        ForeignChain(MODEL, routing_block=16)  # a routing block needs the page size it groups
    assert ForeignChain(MODEL, block_size=4, routing_block=16).routing_block == 16
    assert ForeignChain(MODEL, block_size=32).routing_block == 32


@pytest.mark.parametrize("page", [1, 4])
def test_one_event_translates_to_the_gateways_routing_blocks(page: int) -> None:
    prompt = prompt_of(100)  # 6 routing blocks and 4 tokens
    ids = page_ids(prompt, page)
    chain = ForeignChain(MODEL, block_size=page, routing_block=ROUTING)
    out = chain.apply([store(ids, prompt, 0, len(ids), page)])
    assert out == [BlockStored(tuple(kv(prompt)), None)]
    assert sorted(chain.held()) == sorted(kv(prompt))
    # Every page is known; only those completing a routing block name a kvgate hash.
    assert len(chain) == len(ids) and all(chain.known(i) for i in ids)
    per_group = ROUTING // page
    assert [chain.kvgate_hash(i) for i in ids[per_group - 1 :: per_group]] == kv(prompt)
    assert {chain.kvgate_hash(i) for i in ids} - set(kv(prompt)) == {None}
    assert chain.unindexable_blocks == chain.unknown_parent_blocks == 0


@pytest.mark.parametrize(("page", "cuts"), [(1, [5, 18, 19, 40, 77, 100]), (4, [3, 5, 6, 13, 25])])
def test_a_chain_stored_over_events_that_split_groups(page: int, cuts: list[int]) -> None:
    """Chunked prefill and generated tokens: events whose boundaries fall inside routing blocks. A group
    completes in the event of its last page, chained on the hash its parent page carried over."""
    prompt = prompt_of(cuts[-1] * page)
    ids = page_ids(prompt, page)
    chain = ForeignChain(MODEL, block_size=page, routing_block=ROUTING)
    out: list[KvEvent] = []
    for first, last in zip([0, *cuts], cuts, strict=False):
        out += chain.apply([store(ids, prompt, first, last, page)])
    expected = kv(prompt)
    assert stored_hashes(out) == expected
    # Each stored batch names the routing block before its first hash as its parent (None: the root).
    parents = [e.parent for e in out if isinstance(e, BlockStored)]
    firsts = [expected.index(e.block_hashes[0]) for e in out if isinstance(e, BlockStored)]
    assert parents == [expected[i - 1] if i else None for i in firsts]


def test_a_salted_chain_continues_in_its_namespace() -> None:
    prompt = prompt_of(40)
    ids = page_ids(prompt, 1)
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    out = chain.apply([store(ids, prompt, 0, 10, 1, cache_salt="tenant-a")])
    out += chain.apply([store(ids, prompt, 10, 40, 1)])  # the salt is on the root event only
    assert stored_hashes(out) == kv(prompt, salt="tenant-a") != kv(prompt)


def test_a_branch_from_inside_a_group_resolves_through_its_pages() -> None:
    """Two prompts share 20 tokens: the second's pages chain on page 19, in the middle of block 2."""
    a = prompt_of(48)
    b = a[:20] + prompt_of(28, start=5000)
    ids_a, ids_b = page_ids(a, 1), page_ids(b, 1)
    assert ids_a[:20] == ids_b[:20] and ids_a[20] != ids_b[20]
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    assert stored_hashes(chain.apply([store(ids_a, a, 0, 48, 1)])) == kv(a)
    out = chain.apply([store(ids_b, b, 20, 48, 1)])
    assert out == [BlockStored(tuple(kv(b)[1:]), kv(b)[0])]
    assert sorted(chain.held()) == sorted(set(kv(a)) | set(kv(b)))


def test_tail_first_eviction_removes_a_group_with_its_last_page() -> None:
    prompt = prompt_of(50)  # 3 routing blocks and 2 pages
    ids = page_ids(prompt, 1)
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    chain.apply([store(ids, prompt, 0, 50, 1)])
    gone: list[int] = []
    for n in range(50, 0, -1):  # SGLang evicts leaves: the chain's last page first
        gone += removed_hashes(chain.apply([ForeignRemoved((ids[n - 1],))]))
        assert sorted(chain.held()) == sorted(kv(prompt[: n - 1]))
        assert len(chain) == n - 1
    assert gone == kv(prompt)[::-1]


def test_pages_of_four_evicted_in_one_event() -> None:
    prompt = prompt_of(40)  # 10 pages: 2 routing blocks and 2 pages
    ids = page_ids(prompt, 4)
    chain = ForeignChain(MODEL, block_size=4, routing_block=ROUTING)
    chain.apply([store(ids, prompt, 0, 10, 4)])
    out = chain.apply([ForeignRemoved(tuple(ids[:5:-1]))])  # pages 9..6: block 2 goes with page 7
    assert out == [BlockRemoved((kv(prompt)[1],))]
    assert chain.held() == kv(prompt)[:1]


def test_duplicate_copies_are_reference_counted() -> None:
    prompt = prompt_of(36)
    ids = page_ids(prompt, 1)
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    first = chain.apply([store(ids, prompt, 0, 20, 1)])
    again = chain.apply([store(ids, prompt, 0, 20, 1)])  # a second physical copy of pages 0-19
    assert stored_hashes(first) == kv(prompt)[:1] and again == []
    # Either copy continues the chain: block 2 completes from the state its pages carry.
    assert stored_hashes(chain.apply([store(ids, prompt, 20, 36, 1)])) == kv(prompt)[1:]
    assert removed_hashes(chain.apply([ForeignRemoved((ids[15],))])) == []  # one copy of block 1 is left
    assert chain.holds(kv(prompt)[0])
    assert removed_hashes(chain.apply([ForeignRemoved((ids[15],))])) == kv(prompt)[:1]
    assert chain.apply([ForeignRemoved((ids[15],)), ForeignRemoved((12345,))]) == []  # unknown: ignored
    assert chain.held() == kv(prompt)[1:2]


def test_unknown_parents_are_skipped_and_counted_with_their_children() -> None:
    prompt = prompt_of(48)
    ids = page_ids(prompt, 1)
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    assert chain.apply([store(ids, prompt, 10, 30, 1)]) == []  # page 9 was never announced
    assert chain.unknown_parent_blocks == 20
    assert chain.apply([store(ids, prompt, 30, 48, 1)]) == []  # its children: unknown as well
    assert chain.unknown_parent_blocks == 38 and chain.held() == [] and len(chain) == 0


def test_an_unindexable_page_inside_a_group_stops_the_chain_there() -> None:
    """A multimodal page in the middle of block 2: block 1 is indexed, nothing from block 2 on; the pages
    after it are known (not unknown parents), and so are their children."""
    prompt = prompt_of(48)
    ids = page_ids(prompt, 1)
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    extra: tuple[tuple[Any, ...] | None, ...] = (None,) * 20 + ((["img", 0],),) + (None,) * 4
    out = chain.apply([store(ids, prompt, 0, 25, 1, extra_keys=extra)])
    assert stored_hashes(out) == kv(prompt)[:1]
    assert chain.apply([store(ids, prompt, 25, 48, 1)]) == []
    assert chain.unknown_parent_blocks == 0 and chain.unindexable_blocks == 5 + 23
    assert chain.known(ids[47])
    # Pages of another size (SGLang's short last page) are never indexed either.
    assert chain.apply([ForeignStored((7,), None, prompt[:2], 2)]) == []
    assert chain.held() == kv(prompt)[:1]


def test_ranks_and_clears_keep_their_guarantees() -> None:
    prompt = prompt_of(40)
    ids = page_ids(prompt, 1)
    other = [i + 1 for i in ids]  # rank 1's ids differ (another seed); its kvgate hashes do not
    chain = ForeignChain(MODEL, block_size=1, routing_block=ROUTING)
    assert stored_hashes(chain.apply([store(ids, prompt, 0, 40, 1)], rank=0)) == kv(prompt)
    assert chain.apply([store(other, prompt, 0, 20, 1)], rank=1) == []  # block 1: already held
    assert chain.apply([ForeignCleared()], rank=0) == [BlockRemoved((kv(prompt)[1],))]
    assert chain.held() == kv(prompt)[:1]
    assert chain.apply([ForeignCleared()], rank=1) == [AllCleared()]
    assert chain.held() == [] and len(chain) == 0
    chain.apply([store(ids, prompt, 0, 40, 1)], rank=0)
    chain.apply([store(other, prompt, 0, 16, 1)], rank=1)
    chain.reset_rank(0)
    assert chain.held() == kv(prompt)[:1] and not chain.known(ids[0])


def test_routing_block_equal_to_the_page_is_todays_translation() -> None:
    prompt = prompt_of(64)
    ids = page_ids(prompt, 16)
    plain = ForeignChain(MODEL, block_size=16)
    same = ForeignChain(MODEL, block_size=16, routing_block=16)
    event = store(ids, prompt, 0, 4, 16)
    assert same.apply([event]) == plain.apply([event]) == [BlockStored(tuple(kv(prompt)), None)]
    assert same.apply([ForeignRemoved((ids[3],))]) == plain.apply([ForeignRemoved((ids[3],))])


@pytest.mark.parametrize("seed", range(6))
def test_random_prompts_stores_and_tail_first_evictions_match_the_surviving_pages(seed: int) -> None:
    """An engine with a radix cache of pages: prompts sharing prefixes, stored in random chunks (a hit
    announces nothing), leaves evicted one at a time. After every step the index holds exactly the routing
    blocks whose last page the engine holds, under the gateway's hashes of each prompt."""
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4])
    chain = ForeignChain(MODEL, block_size=page, routing_block=ROUTING)
    stems = [prompt_of(rng.randrange(8, 40), start=10_000 * (i + 1)) for i in range(3)]
    held: dict[int, tuple[int, ...]] = {}  # page id the engine holds -> the tokens up to its end
    children: dict[int, set[int]] = {}
    parents: dict[int, int | None] = {}

    def expected() -> set[int]:
        out = set()
        for tokens in held.values():
            if len(tokens) % ROUTING == 0:
                out.add(kv(list(tokens))[-1])
        return out

    for _ in range(60):
        if held and rng.random() < 0.4:
            for _ in range(rng.randrange(1, 6)):
                leaves = [i for i in held if not children.get(i)]
                if not leaves:
                    break
                leaf = rng.choice(leaves)
                chain.apply([ForeignRemoved((leaf,))])
                del held[leaf]
                parent = parents.pop(leaf)
                if parent is not None:
                    children[parent].discard(leaf)
        else:
            prompt = rng.choice(stems) + prompt_of(rng.randrange(0, 60), start=rng.randrange(4) * 100)
            ids = page_ids(prompt, page)
            hit = 0
            while hit < len(ids) and ids[hit] in held:
                hit += 1
            at = hit
            while at < len(ids):
                end = min(len(ids), at + rng.randrange(1, 24))
                chain.apply([store(ids, prompt, at, end, page)])
                for i in range(at, end):
                    held[ids[i]] = tuple(prompt[: (i + 1) * page])
                    parents[ids[i]] = ids[i - 1] if i else None
                    if i:
                        children.setdefault(ids[i - 1], set()).add(ids[i])
                at = end
        assert set(chain.held()) == expected()
        assert len(chain) == len(held)
    assert chain.unknown_parent_blocks == chain.unindexable_blocks == 0
