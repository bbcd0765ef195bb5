"""ONE contract suite for every ResidencyIndex backend: in process, and Redis (the real server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from cache.events import AllCleared, BlockRemoved, BlockStored, KvEventBatch
from cache.hashing import block_hashes, namespace_seed, to_hex
from cache.redis_keys import RedisKeys
from cache.residency import ResidencyIndex
from cache.residency_memory import MemoryResidencyIndex
from cache.residency_redis import RedisResidencyIndex, hex_run

H = block_hashes(list(range(16 * 8)), 16, namespace_seed("m"))  # a chain of 8 block hashes
OTHER = block_hashes(list(range(1000, 1000 + 16 * 4)), 16, namespace_seed("m"))


@pytest.fixture(params=["memory", "redis"])
async def index(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> AsyncIterator[ResidencyIndex]:
    if request.param == "memory":
        yield MemoryResidencyIndex()
    else:
        yield RedisResidencyIndex(redis_client, redis_keys)


async def test_backends_satisfy_the_protocol(index: ResidencyIndex) -> None:
    assert isinstance(index, ResidencyIndex)


async def test_longest_prefix_per_engine(index: ResidencyIndex) -> None:
    await index.add("a", H[:5])
    await index.add("b", H[:2])
    await index.add("c", OTHER)
    assert await index.longest_prefix(H) == {"a": 5, "b": 2}
    assert await index.longest_prefix(H[:3]) == {"a": 3, "b": 2}
    assert await index.longest_prefix(OTHER[:2]) == {"c": 2}
    assert await index.longest_prefix([]) == {}


async def test_a_hole_in_the_chain_ends_the_prefix(index: ResidencyIndex) -> None:
    await index.add("a", [H[0], H[1], H[3], H[4]])
    assert await index.longest_prefix(H) == {"a": 2}


async def test_no_first_block_means_no_match(index: ResidencyIndex) -> None:
    await index.add("a", H[1:6])
    assert await index.longest_prefix(H) == {}


async def test_remove_and_clear(index: ResidencyIndex) -> None:
    await index.add("a", H)
    await index.add("b", H)
    await index.remove("a", [H[3]])
    assert await index.longest_prefix(H) == {"a": 3, "b": 8}
    await index.remove("a", [12345])  # unknown: ignored
    await index.clear("b")
    assert await index.longest_prefix(H) == {"a": 3}
    assert (await index.holdings("b")).exact == frozenset()


async def test_apply_batches_in_order_and_rejects_stale_ones(index: ResidencyIndex) -> None:
    b1 = KvEventBatch("engine-self-name", 1, 0.0, (BlockStored(tuple(H[:4]), None),))
    b2 = KvEventBatch("engine-self-name", 2, 0.0, (BlockRemoved((H[2],)), BlockStored(tuple(H[4:6]), H[3])))
    assert await index.apply("a", b1)
    assert await index.apply("a", b2)
    assert await index.longest_prefix(H) == {"a": 2}
    assert not await index.apply("a", b1)  # a duplicate delivery changes nothing
    assert await index.longest_prefix(H) == {"a": 2}
    b3 = KvEventBatch("x", 3, 0.0, (AllCleared(), BlockStored(tuple(H[:1]), None)))
    assert await index.apply("a", b3)
    assert await index.longest_prefix(H) == {"a": 1}
    held = await index.holdings("a")
    assert held.seq == 3 and held.exact == frozenset(H[:1])


async def test_replace_is_a_snapshot(index: ResidencyIndex) -> None:
    await index.add("a", H)
    await index.add("a", OTHER, ttl_s=60)
    await index.replace("a", H[:2], seq=41)
    assert await index.longest_prefix(H) == {"a": 2}
    assert await index.longest_prefix(OTHER) == {}
    assert not await index.apply("a", KvEventBatch("a", 41, 0.0, ()))
    assert await index.apply("a", KvEventBatch("a", 42, 0.0, ()))
    # An engine that restarted reports a lower seq in its snapshot; replace accepts it.
    await index.replace("a", H[:1], seq=0)
    assert (await index.holdings("a")).seq == 0


async def test_approximate_entries_expire(index: ResidencyIndex) -> None:
    await index.add("a", H[:4], ttl_s=0.3)
    await index.add("b", H[:4])
    assert await index.longest_prefix(H) == {"a": 4, "b": 4}
    held = await index.holdings("a")
    assert held.exact == frozenset() and set(held.approximate) == set(H[:4])
    assert all(0 < ttl <= 0.3 for ttl in held.approximate.values())
    await asyncio.sleep(0.45)
    assert await index.longest_prefix(H) == {"b": 4}
    assert await index.sweep() == 4
    assert (await index.holdings("a")).approximate == {}


async def test_approximate_add_never_downgrades_an_exact_entry(index: ResidencyIndex) -> None:
    await index.add("a", H[:2])
    await index.add("a", H[:4], ttl_s=0.2)
    await asyncio.sleep(0.3)
    assert await index.longest_prefix(H) == {"a": 2}
    held = await index.holdings("a")
    assert held.exact == frozenset(H[:2])


async def test_exact_add_upgrades_an_approximate_entry(index: ResidencyIndex) -> None:
    await index.add("a", H[:2], ttl_s=0.2)
    await index.add("a", H[:2])
    await asyncio.sleep(0.3)
    await index.sweep()
    assert await index.longest_prefix(H) == {"a": 2}


async def test_engines_lists_what_the_index_knows(index: ResidencyIndex) -> None:
    await index.add("a", H[:1])
    await index.apply("b", KvEventBatch("b", 1, 0.0, ()))
    assert await index.engines() == ["a", "b"]


async def test_long_prompt_lookup(index: ResidencyIndex) -> None:
    chain = block_hashes(list(range(16 * 3000)), 16, namespace_seed("m"))
    await index.add("a", chain)
    await index.add("b", chain[:1500])
    assert await index.longest_prefix(chain) == {"a": 3000, "b": 1500}


async def test_events_of_thousands_of_blocks(index: ResidencyIndex) -> None:
    # One event may carry more hashes than one variadic Redis call takes; approximate entries of the same
    # engine must still leave when their blocks are stored exactly or evicted.
    chain = block_hashes(list(range(16 * 9000)), 16, namespace_seed("m"))
    await index.add("a", chain[8990:], ttl_s=60)  # the expiry set is not empty from here on
    stored = KvEventBatch("a", 1, 0.0, (BlockStored(tuple(chain[:9000])),))
    assert await index.apply("a", stored)
    held = await index.holdings("a")
    assert held.exact == frozenset(chain) and held.approximate == {}
    await index.add("a", OTHER, ttl_s=60)
    removed = KvEventBatch("a", 2, 0.0, (BlockRemoved(tuple(chain[4000:])), BlockRemoved(tuple(OTHER[:2]))))
    assert await index.apply("a", removed)
    held = await index.holdings("a")
    assert held.exact == frozenset(chain[:4000]) and set(held.approximate) == set(OTHER[2:])
    assert await index.longest_prefix(chain) == {"a": 4000}


async def test_redis_lookup_is_one_round_trip(redis_client: aioredis.Redis, redis_keys: RedisKeys) -> None:
    index = RedisResidencyIndex(redis_client, redis_keys)
    chain = block_hashes(list(range(16 * 500)), 16, namespace_seed("m"))
    await index.add("a", chain)
    await index.longest_prefix(chain[:1])  # the script is loaded now: later calls are a bare EVALSHA
    sent: list[object] = []
    real = redis_client.execute_command

    async def counting(*args: object, **kwargs: object) -> object:
        sent.append(args[0])
        return await real(*args, **kwargs)

    redis_client.execute_command = counting  # type: ignore[method-assign]
    try:
        assert await index.longest_prefix(chain) == {"a": 500}
    finally:
        del redis_client.execute_command
    assert sent == ["EVALSHA"]


@given(st.lists(st.integers(0, 2**64 - 1), max_size=50))
def test_a_hex_run_is_the_hashes_as_redis_keys_name_them(hashes: list[int]) -> None:
    assert hex_run(hashes) == "".join(to_hex(h) for h in hashes)


# -- Redis: a bounded, expiring mirror ---------------------------------------------------------------------


async def test_redis_forgets_an_approximate_entry_after_its_ttl_without_a_sweep(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    index = RedisResidencyIndex(redis_client, redis_keys)
    await index.add("a", H[:4], ttl_s=0.3)
    blocks = [redis_keys.block(to_hex(h)) for h in H[:4]]
    assert await redis_client.exists(*blocks) == 4
    assert all(0 < ms <= 300 for ms in [await redis_client.pttl(b) for b in blocks])
    await asyncio.sleep(0.45)
    assert await redis_client.exists(*blocks) == 0  # gone by itself: no sweep ran
    assert (await index.holdings("a")).approximate == {}
    assert await index.longest_prefix(H) == {}
    assert await index.sweep() == 4
    assert await redis_client.scard(redis_keys.engine_blocks("a")) == 0
    assert await redis_client.zcard(redis_keys.engine_expiry("a")) == 0


async def test_redis_block_key_expires_only_while_it_holds_no_exact_entry(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    index = RedisResidencyIndex(redis_client, redis_keys)
    key = redis_keys.block(to_hex(H[0]))
    await index.add("a", H[:1], ttl_s=60)
    assert 59_000 < await redis_client.pttl(key) <= 60_000
    await index.add("b", H[:1], ttl_s=120)  # a later approximate entry extends the key's life
    assert 119_000 < await redis_client.pttl(key) <= 120_000
    await index.add("c", H[:1])  # an exact entry lands: the key stays
    assert await redis_client.pttl(key) == -1
    await index.add("a", H[:1], ttl_s=600)  # approximate entries beside an exact one: still no expiry
    assert await redis_client.pttl(key) == -1
    await index.apply("c", KvEventBatch("c", 1, 0.0, (BlockRemoved((H[0],)),)))
    assert 599_000 < await redis_client.pttl(key) <= 600_000  # the last exact entry left: expires again
    await index.clear("a")
    await index.clear("b")
    assert await redis_client.exists(key) == 0


async def test_redis_heals_a_persistent_key_of_approximate_entries_only(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    # Written before block keys expired: a persistent key with an approximate entry and no exact one.
    index = RedisResidencyIndex(redis_client, redis_keys)
    key = redis_keys.block(to_hex(H[0]))
    server_ms = int((await redis_client.time())[0]) * 1000
    await redis_client.hset(key, "old", server_ms + 30_000)
    await index.add("a", H[:1], ttl_s=60)
    assert 59_000 < await redis_client.pttl(key) <= 60_000


async def test_redis_caps_approximate_entries_per_engine(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    index = RedisResidencyIndex(redis_client, redis_keys, max_approximate_per_engine=5)
    await index.add("a", H[:2])  # exact entries do not count
    await index.add("a", OTHER, ttl_s=120)
    await index.add("a", H[2:6], ttl_s=30)  # 8 approximate entries: the 3 soonest to expire go
    await index.add("b", H[2:6], ttl_s=30)  # another engine has a cap of its own
    held = await index.holdings("a")
    assert held.exact == frozenset(H[:2])
    assert set(OTHER) <= set(held.approximate) and len(held.approximate) == 5
    assert await redis_client.zcard(redis_keys.engine_expiry("a")) == 5
    assert await redis_client.scard(redis_keys.engine_blocks("a")) == 2 + 5
    dropped = [h for h in H[2:6] if h not in held.approximate]
    assert len(dropped) == 3
    for h in dropped:  # gone from the block key too, where the other engine's entry stays
        assert await redis_client.hkeys(redis_keys.block(to_hex(h))) == [b"b"]
    assert set((await index.holdings("b")).approximate) == set(H[2:6])


async def test_redis_sweep_runs_once_per_interval_however_many_gateways(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    first, second = (RedisResidencyIndex(redis_client, redis_keys) for _ in range(2))
    await first.add("a", H[:3], ttl_s=0.05)
    await asyncio.sleep(0.1)
    assert await first.sweep_shared(0.3, "gw-1") == 3
    assert await second.sweep_shared(0.3, "gw-2") is None  # within the interval: the other one swept
    await second.add("a", H[:1], ttl_s=0.05)
    await asyncio.sleep(0.35)
    assert await second.sweep_shared(0.3, "gw-2") == 1
