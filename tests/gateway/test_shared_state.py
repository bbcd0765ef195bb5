"""Gateways sharing sessions and residency through a real Redis: the newest binding wins across outages, a
follower that lost the updates channel catches up, stale bindings are corrected, claims are undone, and the
Redis mirror of residency is swept.

A "gateway" here is a ``SharedState`` on a Redis client built as the gateway builds it. Breaks are real: a
private ``redis-server`` stopped and restarted, or a TCP relay between one gateway and Redis that the test
cuts (a network partition) or holds (a short break the client gets over by itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from cache.hashing import block_hashes, namespace_seed
from cache.redis_keys import RedisKeys
from cache.residency_redis import RedisResidencyIndex
from cache.sessions import SessionBinding
from cache.sessions_redis import RedisSessionStore
from gateway.redis_connection import redis_client
from gateway.state.shared_state import SharedState
from tests.harness import MODEL, ClusterFactory
from tests.redis_process import RedisProcess

H = block_hashes(list(range(16 * 4)), 16, namespace_seed("m"))
ENGINE = "eu-west/e9"  # an engine without KV events, whose residency gateways share as approximate records


def binding(engine: str) -> SessionBinding:
    """A routing decision made now."""
    return SessionBinding(engine.split("/")[0], engine, time.time())


async def eventually(predicate: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


class Relay:
    """A TCP relay between one gateway and Redis. ``cut``: every connection closed and new ones refused (a
    partition). ``hold``: connections closed, new ones accepted but silent until ``release`` (a break short
    enough for the Redis client to reconnect by itself)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.path = parts.path or "/0"  # the database: the same as the direct connections'
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open = asyncio.Event()
        self._open.set()
        self._streams: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}{self.path}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        self._drop_connections()

    async def restore(self) -> None:
        await self.start()

    def hold(self) -> None:
        self._open.clear()
        self._drop_connections()

    def release(self) -> None:
        self._open.set()

    async def close(self) -> None:
        await self.cut()
        self._open.set()

    def _drop_connections(self) -> None:
        for stream in list(self._streams):
            stream.close()
        self._streams.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._streams.add(writer)
        try:
            await self._open.wait()
            if writer.is_closing():
                return
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._streams.add(up_writer)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def gateways(*urls: str, prefix: str, **options: Any) -> AsyncIterator[list[SharedState]]:
    """One started ``SharedState`` per Redis URL, all under ``prefix``, each subscribed to the updates channel
    before this yields (a message sent earlier would reach no one)."""
    keys = RedisKeys(prefix)
    clients = [redis_client(url, 16) for url in urls]
    states = [
        SharedState(gateway_id=f"gw-{i}", redis=client, keys=keys, **options)
        for i, client in enumerate(clients)
    ]
    try:
        for state in states:
            state.writer.probe_interval_s = 0.05
            await state.start([ENGINE])
        for client in clients:
            await _subscribed(client, keys.updates_channel, len(urls))  # (every URL reaches one Redis)
        yield states
    finally:
        for state in states:
            await state.stop()
        for client in clients:
            await client.aclose()


async def _subscribed(client: aioredis.Redis, channel: str, count: int) -> None:
    deadline = time.monotonic() + 5
    while True:
        [(_, subscribers)] = await client.pubsub_numsub(channel)
        if subscribers >= count:
            return
        if time.monotonic() > deadline:
            raise AssertionError("the gateways did not subscribe to the updates channel")
        await asyncio.sleep(0.02)


@pytest.fixture
async def relay(redis_url: str) -> AsyncIterator[Relay]:
    """A relay to the tests' shared Redis."""
    r = Relay(redis_url)
    await r.start()
    yield r
    await r.close()


def held(state: SharedState, session_id: str) -> SessionBinding | None:
    return state.sessions.peek_now("t", session_id)


# -- newest binding wins across an outage ------------------------------------------------------------------


@pytest.mark.parametrize("last", ["a", "b"])
async def test_the_newest_binding_wins_after_an_outage_whichever_gateway_recovers_last(
    private_redis: RedisProcess, last: str
) -> None:
    # The gateway that recovers last reaches Redis through a relay that stays cut until the other has
    # rebuilt what it holds; the outage itself is the Redis server stopped and restarted.
    partition = Relay(private_redis.url)
    await partition.start()
    urls = [partition.url if name == last else private_redis.url for name in ("a", "b")]
    try:
        async with gateways(*urls, prefix="kvgate-outage") as (a, b):
            old = a.bind_session("t", "s", binding("eu-west/e0"))
            await a.writer.flush()
            await eventually(lambda: held(b, "s") == old)

            private_redis.stop()
            await partition.cut()
            new = b.bind_session("t", "s", binding("us-east/e1"))  # newer, while Redis is away
            a.bind_session("t", "during", binding("eu-west/e0"))  # A's writes fail too: it will rebuild
            await eventually(lambda: a.writer.failing and b.writer.failing)

            private_redis.start()
            first, second = (b, a) if last == "a" else (a, b)
            await eventually(lambda: not first.writer.failing and not len(first.writer))
            assert await first.writer.flush()
            assert second.writer.failing  # still away: what the first rebuilt, it has not heard
            await partition.restore()
            await eventually(lambda: not second.writer.failing)
            assert await second.writer.flush()
            await eventually(lambda: held(a, "s") == new and held(b, "s") == new)

            client = aioredis.from_url(private_redis.url)
            store = RedisSessionStore(client, RedisKeys("kvgate-outage"))
            assert await store.get("t", "s") == new
            assert await store.get("t", "during") is not None  # A's own binding of the outage, rebuilt
            await client.aclose()
    finally:
        await partition.close()


async def test_an_older_decision_that_arrives_later_loses_everywhere(
    redis_url: str, redis_keys: RedisKeys, redis_client: aioredis.Redis
) -> None:
    async with gateways(redis_url, redis_url, prefix=redis_keys.prefix) as (a, b):
        earlier = binding("us-east/e1")
        newer = a.bind_session("t", "s", binding("eu-west/e0"))
        await a.writer.flush()
        b.bind_session("t", "s", earlier)  # decided first, written second
        assert held(b, "s") == earlier  # (this gateway's own decision is held at once)
        await b.writer.flush()
        assert held(b, "s") == newer  # Redis answered with the newer one
        assert held(a, "s") == newer
        store = RedisSessionStore(redis_client, redis_keys)
        assert await store.get("t", "s") == newer


async def test_the_first_claim_of_a_new_session_wins_everywhere_whatever_its_time(
    redis_url: str, redis_keys: RedisKeys, redis_client: aioredis.Redis
) -> None:
    async with gateways(redis_url, redis_url, prefix=redis_keys.prefix) as (a, b):
        first = a.bind_session("t", "s", binding("eu-west/e0"), claim=True)
        await a.claims[("t", "s")]
        later = b.bind_session("t", "s", binding("us-east/e1"), claim=True)  # newer, but second
        assert held(b, "s") == later  # (held at once, until Redis answers)
        assert await b.claims[("t", "s")] == first and held(b, "s") == first
        assert not a.claims and not b.claims
        assert await RedisSessionStore(redis_client, redis_keys).get("t", "s") == first
        moved = b.bind_session("t", "s", binding("us-east/e1"))  # a move after the claim: newest wins
        await b.writer.flush()
        await eventually(lambda: held(a, "s") == moved)


async def test_a_claim_redis_does_not_answer_keeps_the_local_decision() -> None:
    client = redis_client("redis://127.0.0.1:1/0", 4)  # nothing listens there
    state = SharedState(gateway_id="alone", redis=client, redis_read_timeout_s=0.2)
    try:
        mine = state.bind_session("t", "s", binding("eu-west/e0"), claim=True)
        assert await asyncio.wait_for(state.claims[("t", "s")], 2) == mine
        assert state.redis_errors == 1 and len(state.writer) == 1  # the write waits for Redis's return
    finally:
        await client.aclose()


async def test_an_unstamped_binding_is_stamped_when_bound() -> None:
    state = SharedState(gateway_id="solo")
    before = time.time()
    bound = state.bind_session("t", "s", SessionBinding("eu-west", "eu-west/e0"))
    assert bound.made_at >= before and state.sessions.peek_now("t", "s") == bound


# -- a follower that lost the channel catches up ------------------------------------------------------------


async def test_a_follower_back_on_the_channel_re_reads_what_it_missed(
    relay: Relay, redis_url: str, redis_keys: RedisKeys
) -> None:
    async with gateways(relay.url, redis_url, prefix=redis_keys.prefix) as (a, b):
        moved = a.bind_session("t", "moved", binding("eu-west/e0"))
        dropped = a.bind_session("t", "dropped", binding("eu-west/e1"))
        await a.writer.flush()
        await eventually(lambda: held(b, "moved") == moved and held(b, "dropped") == dropped)

        await relay.cut()
        await eventually(lambda: a.redis_errors > 0)  # A's follower lost the channel
        new = b.bind_session("t", "moved", binding("us-east/e1"))
        b.release_session("t", "dropped", dropped, None)  # gone from Redis
        b.record_route(ENGINE, H, 60.0, share=True)
        assert await b.writer.flush()
        assert held(a, "moved") == moved and held(a, "dropped") == dropped and not a.lookup(H)

        await relay.restore()
        await eventually(
            lambda: (
                held(a, "moved") == new and held(a, "dropped") is None and a.lookup(H) == {ENGINE: len(H)}
            ),
            within_s=15,
        )
        assert a.resyncs >= 1


async def test_a_channel_that_reconnects_by_itself_re_reads_too(
    relay: Relay, redis_url: str, redis_keys: RedisKeys
) -> None:
    async with gateways(relay.url, redis_url, prefix=redis_keys.prefix) as (a, b):
        old = a.bind_session("t", "s", binding("eu-west/e0"))
        await a.writer.flush()
        await eventually(lambda: held(b, "s") == old)

        relay.hold()  # the channel's connection drops; the client's reconnection waits in the relay
        await asyncio.sleep(0.1)
        new = b.bind_session("t", "s", binding("us-east/e1"))
        assert await b.writer.flush()  # published while A was not subscribed
        await asyncio.sleep(0.1)
        assert held(a, "s") == old
        relay.release()
        await eventually(lambda: held(a, "s") == new)
        assert a.resyncs == 1 and a.redis_errors == 0  # the client reconnected by itself, and A heard of it


# -- the local TTL follows the shared one -------------------------------------------------------------------


async def test_a_stale_binding_is_corrected_when_its_ttl_slides(
    redis_url: str, redis_keys: RedisKeys, redis_client: aioredis.Redis
) -> None:
    async with gateways(redis_url, prefix=redis_keys.prefix, session_ttl_s=3.0) as (a,):
        old = a.bind_session("t", "s", binding("eu-west/e0"))
        gone = a.bind_session("t", "gone", binding("eu-west/e0"))
        await a.writer.flush()
        # Another gateway moved one session and released the other; this one missed both messages.
        elsewhere = RedisSessionStore(redis_client, redis_keys, ttl_s=3.0)
        moved_at = time.monotonic()
        new = binding("us-east/e1")
        assert (await elsewhere.offer("t", "s", new)).binding == new
        assert await elsewhere.release("t", "gone", gone, None)

        await asyncio.sleep(0.35)  # past a tenth of the TTL: the next use slides it in Redis
        assert await a.lookup_session("t", "s") == old  # served from the view; the slide goes out
        assert await a.lookup_session("t", "gone") == gone
        assert await a.writer.flush()
        assert held(a, "s") == new and held(a, "gone") is None
        # Adopted with the life Redis gives it, not a fresh local TTL (which would end 0.35 s later).
        await asyncio.sleep(moved_at + 3.0 + 0.15 - time.monotonic())
        assert held(a, "s") is None


# -- undoing a claim ----------------------------------------------------------------------------------------


async def test_release_restores_the_previous_binding_everywhere(
    redis_url: str, redis_keys: RedisKeys, redis_client: aioredis.Redis
) -> None:
    store = RedisSessionStore(redis_client, redis_keys)
    async with gateways(redis_url, redis_url, prefix=redis_keys.prefix) as (a, b):
        previous = a.bind_session("t", "s", binding("eu-west/e0"))
        claimed = a.bind_session("t", "s", binding("eu-west/e1"))
        await a.writer.flush()
        await eventually(lambda: held(b, "s") == claimed)
        a.release_session("t", "s", claimed, previous)  # the request failed before the engine took it
        assert held(a, "s") == previous
        await a.writer.flush()
        assert await store.get("t", "s") == previous
        await eventually(lambda: held(b, "s") == previous)

        # A claim that a newer decision replaced meanwhile is not undone, anywhere.
        claimed = a.bind_session("t", "s", binding("eu-west/e1"))
        await a.writer.flush()
        newest = b.bind_session("t", "s", binding("us-east/e0"))
        await b.writer.flush()
        await eventually(lambda: held(a, "s") == newest)
        a.release_session("t", "s", claimed, previous)
        await a.writer.flush()
        assert await store.get("t", "s") == newest and held(a, "s") == newest and held(b, "s") == newest

        # A new session's first claim undone: no binding anywhere.
        first = a.bind_session("t", "fresh", binding("eu-west/e1"))
        await a.writer.flush()
        await eventually(lambda: held(b, "fresh") == first)
        a.release_session("t", "fresh", first, None)
        await a.writer.flush()
        assert await store.get("t", "fresh") is None and held(a, "fresh") is None
        await eventually(lambda: held(b, "fresh") is None)


async def test_release_without_redis() -> None:
    state = SharedState(gateway_id="solo")
    previous = state.bind_session("t", "s", binding("eu-west/e0"))
    claimed = state.bind_session("t", "s", binding("eu-west/e1"))
    state.release_session("t", "s", claimed, previous)
    assert held(state, "s") == previous
    state.release_session("t", "s", claimed, None)  # no longer held: nothing to undo
    assert held(state, "s") == previous


# -- the Redis mirror of residency, and the session gauge ---------------------------------------------------


async def test_the_gateway_sweeps_the_redis_mirror(
    redis_url: str, redis_keys: RedisKeys, redis_client: aioredis.Redis
) -> None:
    async with gateways(redis_url, redis_url, prefix=redis_keys.prefix, redis_sweep_every_s=0.2) as (a, _):
        a.record_route(ENGINE, H, 0.1, share=True)
        await a.writer.flush()
        assert await redis_client.zcard(redis_keys.engine_expiry(ENGINE)) == len(H)
        deadline = time.monotonic() + 3
        while await redis_client.zcard(redis_keys.engine_expiry(ENGINE)):
            assert time.monotonic() < deadline, "no gateway swept the expired entries"
            await asyncio.sleep(0.05)
        assert await redis_client.scard(redis_keys.engine_blocks(ENGINE)) == 0


async def test_the_session_gauge_counts_live_bindings(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1}, session_ttl_s=0.5)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for i in range(3):
        status, _, _ = await cluster.post(
            "/v1/chat/completions", body, headers={"x-session-affinity": f"s-{uuid.uuid4().hex}-{i}"}
        )
        assert status == 200
    assert await _gauge(cluster, "kvgate_sessions") == 3
    await asyncio.sleep(0.6)
    assert await _gauge(cluster, "kvgate_sessions") == 0
    assert len(cluster.gateway.state.sessions) == 0  # the scrape swept them


async def _gauge(cluster: Any, name: str) -> float:
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    [line] = [x for x in text.splitlines() if x.startswith(name + " ")]
    return float(line.split()[1])


async def test_the_mirrors_cap_and_sweep_interval_come_from_the_deployment_file(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1},
        redis_url=redis_url,
        redis_prefix=redis_keys.prefix,
        redis_max_approximate_per_engine=7,
        redis_sweep_interval_s=0.5,
    )
    state = cluster.gateway.state
    assert state.redis_index is not None and state.redis_index.max_approximate_per_engine == 7
    assert state._redis_sweep_every_s == 0.5


# -- a Redis that lost its data --------------------------------------------------------------------------


async def test_a_flushed_redis_gets_the_views_back_and_a_new_gateway_keeps_the_sessions(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    """FLUSHDB behind the gateway's back (no write fails): within a few seconds Redis holds its session
    bindings and residency again, and a gateway started afterwards sends each session's next turn to the
    engine the session was on."""
    cluster = await make_cluster({"eu-west": 2}, redis_url=private_redis.url)
    state = cluster.gateway.state
    system = "You are the support assistant of a large company; answer briefly and correctly. " * 8

    def turn(session_id: str, text: str) -> dict[str, Any]:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"{session_id}: {text}"},
        ]
        return {"model": MODEL, "max_tokens": 2, "messages": messages}

    engines: dict[str, str] = {}
    for i in range(6):
        session_id = f"conversation-{i}"
        status, _, headers = await cluster.post(
            "/v1/chat/completions", turn(session_id, "hello"), headers={"x-session-affinity": session_id}
        )
        assert status == 200
        engines[session_id] = headers["x-kvgate-engine"]
    # Half of them moved to the other engine (as a failover would): where nothing else would send them.
    for session_id in list(engines)[::2]:
        other = next(e for e in cluster.engines if e != engines[session_id])
        state.bind_session("default", session_id, binding(other))
        engines[session_id] = other
    assert await state.writer.flush()
    client = aioredis.from_url(private_redis.url)
    keys = RedisKeys(cluster.redis_prefix)
    store = RedisSessionStore(client, keys)
    index = RedisResidencyIndex(client, keys)

    async def in_redis() -> dict[str, str | None]:
        held = {s: await store.get("default", s) for s in engines}
        return {s: b.engine if b is not None else None for s, b in held.items()}

    async def exact_in_redis() -> int:
        return sum([len((await index.holdings(e)).exact) for e in cluster.engines])

    assert await in_redis() == engines and await exact_in_redis() > 0
    await client.flushdb()
    deadline = time.monotonic() + 5
    while await in_redis() != engines or not await exact_in_redis():
        assert time.monotonic() < deadline, "Redis never got the gateway's view back"
        await asyncio.sleep(0.05)
    assert state.data_losses == 1 and not state.writer.failing

    newcomer, url = await cluster.add_gateway("eu-west", redis_url=private_redis.url)
    for session_id, engine in engines.items():
        status, _, headers = await cluster.post(
            "/v1/chat/completions",
            turn(session_id, "and then?"),
            url=url,
            headers={"x-session-affinity": session_id},
        )
        assert status == 200
        assert (headers["x-kvgate-engine"], headers["x-kvgate-route"]) == (engine, "session")
    await asyncio.sleep(1.5)  # (a check or two more: nothing else was lost)
    assert state.data_losses == 1 and newcomer.state.data_losses == 0
    await client.aclose()


async def test_every_gateway_writes_its_view_back_after_a_flush_whichever_notices_first(
    private_redis: RedisProcess,
) -> None:
    """One marker for the deployment: the gateway that notices first sets a new one, and the others,
    finding a marker they did not read before, know the data was lost all the same."""
    async with gateways(private_redis.url, private_redis.url, prefix="kvgate-flushed") as (a, b):
        a.bind_session("t", "of-a", binding("eu-west/e0"))
        b.bind_session("t", "of-b", binding("us-east/e1"))
        assert await a.writer.flush() and await b.writer.flush()
        client = aioredis.from_url(private_redis.url)
        store = RedisSessionStore(client, RedisKeys("kvgate-flushed"))
        await client.flushdb()
        deadline = time.monotonic() + 5
        while await store.get("t", "of-a") is None or await store.get("t", "of-b") is None:
            assert time.monotonic() < deadline, "a gateway did not write its view back"
            await asyncio.sleep(0.05)
        assert a.data_losses == b.data_losses == 1
        await client.aclose()


# -- stopping ------------------------------------------------------------------------------------------------


async def test_a_gateways_shared_state_stops_while_its_writer_is_busy_with_redis(
    redis_url: str, redis_keys: RedisKeys
) -> None:
    """The writer checks Redis now and then while it is idle (every second; here without pause, so that a
    stop comes while a command is under way). A cancellation that came as a command was sent was dropped
    (redis-py sent under Python 3.11's ``asyncio.wait_for``): the writer went on checking, and ``stop``, so a
    gateway's shutdown after its drain, waited for it for ever."""
    client = redis_client(redis_url, 16)
    try:
        for n in range(40):
            state = SharedState(gateway_id=f"gw-{n}", redis=client, keys=redis_keys)
            state.writer.check_interval_s = 0.0
            await state.start([ENGINE])
            await asyncio.sleep(0.01 + random.random() * 0.01)
            try:
                async with asyncio.timeout(5):
                    await state.stop()
            except TimeoutError:
                raise AssertionError(f"stop {n} did not end in 5 s") from None
    finally:
        await client.aclose()
