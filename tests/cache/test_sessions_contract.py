"""ONE contract suite for session bindings, in process and in Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from cache.redis_keys import RedisKeys
from cache.sessions import MemorySessionStore, SessionBinding, SessionStore
from cache.sessions_redis import RedisSessionStore


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> AsyncIterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore(ttl_s=0.4)
    else:
        yield RedisSessionStore(redis_client, redis_keys, ttl_s=0.4)


async def test_protocol(store: SessionStore) -> None:
    assert isinstance(store, SessionStore)


async def test_bind_get_move_unbind(store: SessionStore) -> None:
    assert await store.get("t", "s1") is None
    await store.bind("t", "s1", SessionBinding("eu", "eu/e0"))
    assert await store.get("t", "s1") == SessionBinding("eu", "eu/e0")
    await store.bind("t", "s1", SessionBinding("us", "us/e1"))
    assert await store.get("t", "s1") == SessionBinding("us", "us/e1")
    await store.unbind("t", "s1")
    assert await store.get("t", "s1") is None


async def test_sessions_are_scoped_by_tenant(store: SessionStore) -> None:
    await store.bind("tenant-a", "shared-id", SessionBinding("eu", "eu/e0"))
    assert await store.get("tenant-b", "shared-id") is None


async def test_ttl_slides_on_use_and_expires_when_idle(store: SessionStore) -> None:
    await store.bind("t", "s", SessionBinding("eu", "eu/e0"))
    for _ in range(4):  # 4 x 0.2 s > the 0.4 s TTL, but each read restarts it
        await asyncio.sleep(0.2)
        assert await store.get("t", "s") is not None
    await asyncio.sleep(0.55)
    assert await store.get("t", "s") is None


def test_memory_store_is_bounded() -> None:
    store = MemorySessionStore(max_entries=3)
    for i in range(5):
        store.bind_now("t", f"s{i}", SessionBinding("r", f"e{i}"))
    assert len(store) == 3
    assert store.get_now("t", "s0") is None and store.get_now("t", "s4") is not None
