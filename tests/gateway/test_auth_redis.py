"""API keys while Redis is busy or away: a store error is never an authentication verdict (503, not 401),
keys verified before keep working, and concurrent look-ups of one key cost one Redis read."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from cache.redis_keys import RedisKeys
from gateway.tenancy.tenants import Authenticator, KeyRecord, KeyStoreUnavailable, RedisKeyStore, create_key
from tests.harness import MODEL, ClusterFactory
from tests.redis_process import RedisProcess


def chat(content: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def burst(url: str, path: str, body: Any, headers: dict[str, str], n: int) -> Counter[int]:
    """``n`` requests that reach the gateway at once: every connection is open and every request written
    before any answer is read (as from many clients with warm connections); the statuses answered."""
    host, port = url.removeprefix("http://").split(":")
    conns = await asyncio.gather(*(asyncio.open_connection(host, int(port)) for _ in range(n)))
    payload = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head += f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    for _, writer in conns:
        writer.write(head.encode() + payload)

    async def status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        answer = await reader.read()  # to the end: the gateway closes after answering
        writer.close()
        return int(answer.split(b" ", 2)[1])

    return Counter(await asyncio.gather(*(status(r, w) for r, w in conns)))


# -- through a gateway ----------------------------------------------------------------------------------


async def test_a_burst_with_one_valid_key_on_a_cold_gateway_gets_no_401(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    cluster = await make_cluster(
        {"eu-west": 2}, auth={"enabled": True}, redis_url=redis_url, redis_prefix=redis_keys.prefix
    )
    key, _ = await create_key(cluster.gateway.billing.keys, "acme")  # in Redis; the gateway never saw it
    statuses = await burst(cluster.url, "/v1/chat/completions", chat("hello"), bearer(key), 800)
    assert statuses == {200: 800}


async def test_redis_away_answers_503_for_keys_it_cannot_verify_and_200_for_verified_ones(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    cluster = await make_cluster({"eu-west": 1}, auth={"enabled": True}, redis_url=private_redis.url)
    store = cluster.gateway.billing.keys
    verified, _ = await create_key(store, "acme")
    unverified, _ = await create_key(store, "acme")
    path, body = "/v1/chat/completions", chat("hi")
    status, error, _ = await cluster.post(path, body, headers=bearer("kvg-no-such-key-0000000000"))
    assert status == 401 and error["error"]["code"] == "invalid_api_key"  # Redis up: a real verdict
    assert (await cluster.post(path, body, headers=bearer(verified)))[0] == 200

    private_redis.stop()
    assert (await cluster.post(path, body, headers=bearer(verified)))[0] == 200
    status, error, headers = await cluster.post(path, body, headers=bearer(unverified))
    assert status == 503, error
    assert error["error"]["code"] == "auth_unavailable" and "key store" in error["error"]["message"]
    assert (headers["Retry-After"], headers["retry-after-ms"]) == ("2", "2000")
    # A gateway (re)started while Redis is away has verified nothing: it cannot tell either key is valid.
    _, restarted = await cluster.add_gateway("eu-west", auth={"enabled": True}, redis_url=private_redis.url)
    for key in (verified, unverified):
        status, error, headers = await cluster.post(path, body, url=restarted, headers=bearer(key))
        assert status == 503 and "Retry-After" in headers and "retry-after-ms" in headers, error

    private_redis.start()
    for url in (cluster.url, restarted):
        assert (await cluster.post(path, body, url=url, headers=bearer(unverified)))[0] == 200
        assert (await cluster.post(path, body, url=url, headers=bearer(verified)))[0] == 200
        status, _, _ = await cluster.post(path, body, url=url, headers=bearer("kvg-no-such-key-1111111111"))
        assert status == 401


async def test_the_gateways_one_redis_pool_makes_a_burst_wait_instead_of_failing(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1}, redis_url=redis_url, redis_prefix=redis_keys.prefix, redis_max_connections=8
    )
    redis = cluster.gateway.state.redis
    assert redis is not None and cluster.gateway.billing.keys._redis is redis  # type: ignore[attr-defined]
    pool = redis.connection_pool
    assert isinstance(pool, aioredis.BlockingConnectionPool) and pool.max_connections == 8
    # 300 commands at once through 8 connections (one of them the pub/sub follower's): all are answered.
    answers = await asyncio.gather(*(redis.hget(f"{redis_keys.prefix}:keys", str(i)) for i in range(300)))
    assert answers == [None] * 300


# -- the authenticator ----------------------------------------------------------------------------------


class CountingKeyStore(RedisKeyStore):
    """The Redis key store, counting its reads."""

    def __init__(self, redis: aioredis.Redis, prefix: str = "kvgate") -> None:
        super().__init__(redis, prefix)
        self.reads = 0

    async def get(self, key_digest: str) -> KeyRecord | None:
        self.reads += 1
        return await super().get(key_digest)


async def test_concurrent_checks_of_one_key_cost_one_store_read(
    redis_client: aioredis.Redis, redis_keys: RedisKeys
) -> None:
    store = CountingKeyStore(redis_client, redis_keys.prefix)
    key, record = await create_key(store, "acme")
    auth = Authenticator(store)
    assert await asyncio.gather(*(auth.check(key) for _ in range(200))) == [record] * 200
    assert store.reads == 1
    assert await auth.check(key) == record and store.reads == 1  # then a cache hit
    # An unknown key: one read for the whole burst as well, and the store's "no" is the verdict.
    assert await asyncio.gather(*(auth.check("kvg-unknown") for _ in range(50))) == [None] * 50
    assert store.reads == 2


async def test_a_store_that_cannot_answer_gives_no_verdict_and_none_is_remembered(
    private_redis: RedisProcess,
) -> None:
    client = aioredis.from_url(private_redis.url)
    store = CountingKeyStore(client)
    key, record = await create_key(store, "acme")
    auth = Authenticator(store)
    private_redis.stop()
    results = await asyncio.gather(*(auth.check(key) for _ in range(20)), return_exceptions=True)
    assert all(isinstance(r, KeyStoreUnavailable) for r in results), results
    assert store.reads == 1  # the failing read was shared too
    private_redis.start()
    assert await auth.check(key) == record  # not refused: the failure left nothing behind
    await client.aclose()


async def test_keys_verified_before_outlive_their_cache_entry_while_the_store_is_away(
    private_redis: RedisProcess,
) -> None:
    client = aioredis.from_url(private_redis.url)
    store = CountingKeyStore(client)
    key, record = await create_key(store, "acme")
    revoked, revoked_record = await create_key(store, "acme")
    # cache_ttl_s=0: every check goes to the store, so each answer below is what a failed read leaves.
    fail_open = Authenticator(store, cache_ttl_s=0, negative_ttl_s=0, max_stale_s=3600)
    no_stale = Authenticator(store, cache_ttl_s=0, max_stale_s=0)
    fail_closed = Authenticator(store, cache_ttl_s=0, fail_open=False)
    for auth in (fail_open, no_stale, fail_closed):
        assert await auth.check(key) == record
    assert await fail_open.check(revoked) == revoked_record
    await store.remove(revoked_record.key_id)
    assert await fail_open.check(revoked) is None  # the store said so: forgotten, even as a fallback

    private_redis.stop()
    reads = store.reads
    assert await fail_open.check(key) == record
    assert store.reads == reads + 1  # it did ask the store first
    for auth in (no_stale, fail_closed):
        with pytest.raises(KeyStoreUnavailable):
            await auth.check(key)
    with pytest.raises(KeyStoreUnavailable):
        await fail_open.check(revoked)
    await client.aclose()
