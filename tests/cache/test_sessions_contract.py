"""ONE contract suite for session bindings, in process and in Redis; then what each backend adds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import pytest
import redis.asyncio as aioredis

from cache.redis_keys import RedisKeys
from cache.sessions import MemorySessionStore, SessionBinding, SessionStore, response_key
from cache.sessions_redis import HeldBinding, RedisSessionStore

EU = SessionBinding("eu", "eu/e0", 100.0)
US = SessionBinding("us", "us/e1", 200.0)


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore(ttl_s=0.4)
    else:
        yield RedisSessionStore(redis_client, redis_keys, ttl_s=0.4)


@pytest.fixture
def redis_store(redis_client: aioredis.Redis, redis_keys: RedisKeys) -> RedisSessionStore:
    return RedisSessionStore(redis_client, redis_keys, ttl_s=60)


async def test_protocol(store: SessionStore) -> None:
    assert isinstance(store, SessionStore)


async def test_bind_get_move_unbind(store: SessionStore) -> None:
    assert await store.get("t", "s1") is None
    await store.bind("t", "s1", EU)
    assert await store.get("t", "s1") == EU
    await store.bind("t", "s1", US)
    assert await store.get("t", "s1") == US
    await store.unbind("t", "s1")
    assert await store.get("t", "s1") is None


async def test_the_newest_binding_wins(store: SessionStore) -> None:
    await store.bind("t", "s", US)
    await store.bind("t", "s", EU)  # made earlier, arriving later (a rebuild, a late message): ignored
    assert await store.get("t", "s") == US
    await store.bind("t", "s", SessionBinding("eu", "eu/e9", US.made_at))  # a tie keeps the held one
    assert await store.get("t", "s") == US
    await store.bind("t", "s", SessionBinding("eu", "eu/e9", 0.0))  # unstamped loses to stamped
    assert await store.get("t", "s") == US


async def test_sessions_are_scoped_by_tenant(store: SessionStore) -> None:
    await store.bind("tenant-a", "shared-id", EU)
    assert await store.get("tenant-b", "shared-id") is None


async def test_ttl_slides_on_use_and_expires_when_idle(store: SessionStore) -> None:
    await store.bind("t", "s", EU)
    for _ in range(4):  # 4 x 0.2 s > the 0.4 s TTL, but each read restarts it
        await asyncio.sleep(0.2)
        assert await store.get("t", "s") is not None
    await asyncio.sleep(0.55)
    assert await store.get("t", "s") is None


async def test_rebinding_the_held_binding_restarts_its_ttl(store: SessionStore) -> None:
    await store.bind("t", "s", EU)
    for _ in range(3):
        await asyncio.sleep(0.2)
        await store.bind("t", "s", EU)
    assert await store.get("t", "s") == EU


# -- in process -------------------------------------------------------------------------------------------


def test_memory_store_is_bounded() -> None:
    store = MemorySessionStore(max_entries=3)
    for i in range(5):
        store.bind_now("t", f"s{i}", SessionBinding("r", f"e{i}"))
    assert len(store) == 3
    assert store.get_now("t", "s0") is None and store.get_now("t", "s4") is not None


def test_memory_offer_keeps_the_newer_binding() -> None:
    store = MemorySessionStore()
    assert store.offer_now("t", "s", EU)
    assert not store.offer_now("t", "s", SessionBinding("eu", "eu/e5", 50.0))
    assert store.offer_now("t", "s", US)
    assert not store.offer_now("t", "s", EU)
    assert store.get_now("t", "s") == US
    store.bind_now("t", "s", EU)  # this gateway's own decision is held whatever its time
    assert store.get_now("t", "s") == EU


def test_memory_offer_of_an_expired_binding_is_a_fresh_one() -> None:
    now = [0.0]
    store = MemorySessionStore(ttl_s=10, clock=lambda: now[0])
    store.bind_now("t", "s", US)
    now[0] = 11.0
    assert store.offer_now("t", "s", EU)
    assert store.peek_now("t", "s") == EU


def test_memory_replace_if_is_compare_and_set() -> None:
    store = MemorySessionStore()
    store.bind_now("t", "s", US)
    assert not store.replace_if_now("t", "s", EU, None)  # not what it holds: left alone
    assert store.replace_if_now("t", "s", US, EU)
    assert store.peek_now("t", "s") == EU
    assert store.replace_if_now("t", "s", EU, None)
    assert store.peek_now("t", "s") is None


def test_memory_adopted_binding_lives_no_longer_than_given() -> None:
    now = [0.0]
    store = MemorySessionStore(ttl_s=100, clock=lambda: now[0])
    store.offer_now("t", "s", EU, ttl_s=5)
    now[0] = 4.9
    assert store.peek_now("t", "s") == EU
    now[0] = 5.1
    assert store.peek_now("t", "s") is None


def test_live_count_counts_live_bindings_and_sweeps_from_the_front() -> None:
    now = [0.0]
    store = MemorySessionStore(ttl_s=10, clock=lambda: now[0])
    for i in range(5):
        now[0] = float(i)
        store.bind_now("t", f"s{i}", EU)
    assert store.live_count() == 5
    now[0] = 12.5  # s0, s1 and s2 (bound at 0, 1, 2) have expired
    assert store.live_count() == 2 and len(store) == 2
    store.get_now("t", "s3")  # used: moves to the back with a fresh TTL
    now[0] = 14.5
    assert store.live_count() == 1 and store.peek_now("t", "s3") == EU
    assert store.sweep_now() == 0


# -- in Redis ---------------------------------------------------------------------------------------------


async def test_redis_value_carries_made_at_and_a_ttl(
    redis_store: RedisSessionStore, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    await redis_store.bind("t", "s", EU)
    key = redis_keys.session("t", "s")
    assert msgpack.unpackb(await redis_client.get(key)) == ["eu", "eu/e0", 100.0]
    assert 59_000 < await redis_client.pttl(key) <= 60_000


async def test_redis_reads_values_written_before_bindings_were_stamped(
    redis_store: RedisSessionStore, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    await redis_client.set(redis_keys.session("t", "s"), msgpack.packb(["eu", "eu/e0"]), px=60_000)
    assert await redis_store.get("t", "s") == SessionBinding("eu", "eu/e0", 0.0)
    assert (await redis_store.offer("t", "s", US)).binding == US


async def test_redis_offer_answers_what_redis_holds(redis_store: RedisSessionStore) -> None:
    assert await redis_store.offer("t", "s", US) == HeldBinding(US, 60)
    held = await redis_store.offer("t", "s", EU)
    assert held.binding == US and 59 < held.ttl_s <= 60
    many = await redis_store.offer_many([(("t", "s"), EU), (("t", "other"), EU)])
    assert [h.binding for h in many] == [US, EU]


async def test_redis_claim_the_first_claim_wins_whatever_its_time(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    store = RedisSessionStore(redis_client, redis_keys, ttl_s=0.5)
    assert await store.claim("t", "s", EU) == HeldBinding(EU, 0.5)
    assert await store.claim("t", "s", EU) == HeldBinding(EU, 0.5)  # its own claim again: still held
    await asyncio.sleep(0.3)
    held = await store.claim("t", "s", US)  # newer, but second: loses, and the held binding slides
    assert held.binding == EU and 0.45 < held.ttl_s <= 0.5
    claims = await asyncio.gather(*(store.claim("t", "race", b) for b in (US, EU)))
    assert [h.binding for h in claims] == [US, US]  # one winner, whichever came first
    assert (await store.offer("t", "s", US)).binding == US  # a move after the claim: newest wins


async def test_redis_slide_restarts_the_ttl_only_of_the_binding_held(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    store = RedisSessionStore(redis_client, redis_keys, ttl_s=0.5)
    await store.bind("t", "s", US)
    await asyncio.sleep(0.3)
    assert (await store.slide("t", "s", US)).binding == US  # restarted
    await asyncio.sleep(0.3)
    assert await store.get("t", "s") == US
    held = await store.slide("t", "s", EU)  # not what Redis holds: no slide, and the answer says so
    assert held.binding == US and 0 < held.ttl_s <= 0.5
    assert await store.slide("t", "gone", EU) == HeldBinding(None, 0.0)


async def test_redis_release_undoes_only_the_claim_held(
    redis_store: RedisSessionStore, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    claim = SessionBinding("us", "us/e1", 300.0)
    await redis_store.bind("t", "s", EU)
    await redis_store.bind("t", "s", claim)
    assert not await redis_store.release("t", "s", US, EU)  # another claim than the one held
    assert await redis_store.get("t", "s") == claim
    assert await redis_store.release("t", "s", claim, EU)
    assert await redis_store.get("t", "s") == EU
    assert await redis_client.pttl(redis_keys.session("t", "s")) > 0
    await redis_store.bind("t", "new", claim)
    assert await redis_store.release("t", "new", claim, None)
    assert await redis_store.get("t", "new") is None


async def test_redis_read_many_does_not_slide(redis_client: aioredis.Redis, redis_keys: RedisKeys) -> None:
    store = RedisSessionStore(redis_client, redis_keys, ttl_s=0.5)
    await store.bind("t", "a", EU)
    await asyncio.sleep(0.2)
    a, b = await store.read_many([("t", "a"), ("t", "b")])
    assert a.binding == EU and 0.2 < a.ttl_s <= 0.3 + 0.02
    assert b == HeldBinding(None, 0.0)


# -- stored responses' bindings: a TTL of their own ------------------------------------------------------


async def test_a_stored_responses_binding_outlives_a_session(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    # Both lived for the session TTL: a conversation continued after an hour idle (previous_response_id)
    # found no binding, although its engine still kept the response.
    response = response_key("resp_1")
    for store in (
        MemorySessionStore(ttl_s=0.3, response_ttl_s=60),
        RedisSessionStore(redis_client, redis_keys, ttl_s=0.3, response_ttl_s=60),
    ):
        await store.bind("t", "s", EU)
        await store.bind("t", response, US)
        await asyncio.sleep(0.5)
        assert await store.get("t", "s") is None
        assert await store.get("t", response) == US, type(store).__name__
    assert 55_000 < await redis_client.pttl(redis_keys.session("t", response)) <= 60_000


def test_sessions_expire_and_are_swept_behind_a_live_response() -> None:
    # One LRU order for both TTLs would stop the sweep at a long-lived response at the front, and count
    # every expired session behind it as live.
    now = [0.0]
    store = MemorySessionStore(ttl_s=10, response_ttl_s=1000, clock=lambda: now[0])
    store.bind_now("t", response_key("resp_1"), US)
    for i in range(5):
        store.bind_now("t", f"s{i}", EU)
    assert store.live_count() == 6
    now[0] = 11.0
    assert store.live_count() == 1 and len(store) == 1
    assert store.items_now() == [(("t", response_key("resp_1")), US)]
    assert store.get_now("t", response_key("resp_1")) == US
    now[0] = 1010.0  # (the read restarted its TTL)
    assert store.peek_now("t", response_key("resp_1")) == US
    now[0] = 2011.0
    assert store.peek_now("t", response_key("resp_1")) is None and store.live_count() == 0
