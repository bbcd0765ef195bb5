"""KV event publishing (contract 3): numbering, snapshots, the ring buffer, and the HTTP stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp import web

from cache.events import (
    AllCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    batch_from_obj,
    decode_snapshot,
)
from cache.hashing import namespace_seed
from engine.block_manager import BlockManager
from engine.kv_publisher import KvEventPublisher
from engine.sequence import SamplingParams, Sequence
from tests.serving import serve as serve_on_free_port

Serve = Callable[[KvEventPublisher], Awaitable[str]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Serves a publisher's routes on a free port; yields a function returning the base URL."""
    runners: list[web.AppRunner] = []

    async def start(publisher: KvEventPublisher) -> str:
        app = web.Application()
        publisher.add_routes(app)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        runners.append(runner)
        return await serve_on_free_port(runner)

    yield start
    for runner in runners:
        await runner.cleanup()


async def wait_for(predicate: Callable[[], bool], within: float = 2.0) -> None:
    async with asyncio.timeout(within):
        # Polling: the condition is changed by the server's handler task, which signals nothing.
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


class StreamReader:
    """Decodes an x-msgpack-stream body object by object: batches, or None for a heartbeat."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._unpacker = msgpack.Unpacker()
        self._ready: list[Any] = []

    async def next(self, within: float = 2.0) -> KvEventBatch | None:
        async with asyncio.timeout(within):
            while not self._ready:
                data = await self._resp.content.readany()
                if not data:
                    raise EOFError
                self._unpacker.feed(data)
                self._ready.extend(self._unpacker)
        obj = self._ready.pop(0)
        return None if obj is None else batch_from_obj(obj)

    async def next_batch(self, within: float = 2.0) -> KvEventBatch:
        while True:
            item = await self.next(within)
            if item is not None:
                return item


def stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(hashes, None)]


def test_seq_starts_at_one_and_rises_by_one() -> None:
    pub = KvEventPublisher("e1", 16)
    assert pub.seq == 0
    b1 = pub.publish(stored(1))
    b2 = pub.publish([BlockRemoved((1,))])
    assert b1 is not None and b2 is not None
    assert (b1.seq, b2.seq, pub.seq) == (1, 2, 2)
    assert b1.engine == "e1" and b1.ts > 0
    # Nothing to say: no batch, no seq spent.
    assert pub.publish([]) is None
    assert pub.seq == 2


def test_the_block_managers_stored_events_reach_the_wire_with_their_parent() -> None:
    """X + Y and X + Z computed in one step: Z's X was computed twice and stored once, yet Z's event, as a
    consumer decodes it, names X as its parent (vLLM's parent_block_hash), not nothing."""
    bm = BlockManager(16, 4)
    x = list(range(4))
    a = Sequence("a", [*x, *range(10, 14), 1], SamplingParams(), namespace_seed("m"))
    b = Sequence("b", [*x, *range(20, 24), 1], SamplingParams(), namespace_seed("m"))
    for s in (a, b):
        bm.allocate(s)
    for s in (a, b):
        s.num_computed = s.num_tokens
        bm.register_full_blocks(s)
    pub = KvEventPublisher("e1", 4)
    batch = pub.publish(bm.drain_events())
    assert batch is not None
    decoded = batch_from_obj(msgpack.unpackb(batch.encode()))
    ha, hb = a.block_hashes(4), b.block_hashes(4)
    assert decoded.events == (BlockStored((ha[0], ha[1]), None), BlockStored((hb[1],), ha[0]))
    assert sorted(pub.snapshot().block_hashes) == sorted({*ha, *hb})


def test_snapshot_follows_the_events() -> None:
    pub = KvEventPublisher("e1", 32)
    snap = pub.snapshot()
    assert (snap.engine, snap.seq, snap.block_size, snap.block_hashes) == ("e1", 0, 32, ())
    pub.publish([BlockStored((1, 2, 3), None), BlockStored((4,), 3)])
    pub.publish([BlockRemoved((2,))])
    snap = pub.snapshot()
    assert snap.seq == 2
    assert sorted(snap.block_hashes) == [1, 3, 4]
    pub.publish([AllCleared(), BlockStored((9,), None)])
    snap = pub.snapshot()
    assert (snap.seq, snap.block_hashes) == (3, (9,))


def test_backlog_and_gone() -> None:
    from engine.kv_publisher import GoneError

    pub = KvEventPublisher("e1", 16, ring_size=3)
    for h in range(5):
        pub.publish(stored(h))
    assert len(pub.backlog(2)) == 3
    assert pub.backlog(5) == []
    for after in (0, 1, 6, -1):
        with pytest.raises(GoneError):
            pub.backlog(after)


def test_a_subscriber_that_overflows_is_dropped() -> None:
    pub = KvEventPublisher("e1", 16, queue_limit=4)
    _, sub = pub.subscribe(0)
    assert pub.subscriber_count == 1
    for h in range(4):
        pub.publish(stored(h))
    assert not sub.dropped and len(sub.queue) == 4
    pub.publish(stored(99))
    assert sub.dropped and sub.closed
    assert len(sub.queue) == 0  # its memory is freed at once
    assert pub.subscriber_count == 0
    # Later batches do not reach it.
    pub.publish(stored(100))
    assert len(sub.queue) == 0


async def test_snapshot_endpoint(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16)
    pub.publish(stored(1, 2))
    pub.publish([BlockRemoved((1,))])
    url = await serve(pub)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_snapshot") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/msgpack"
        assert resp.headers["x-kv-seq"] == "2"
        snap = decode_snapshot(await resp.read())
    assert (snap.engine, snap.seq, snap.block_size, snap.block_hashes) == ("e1", 2, 16, (2,))


async def test_events_endpoint_backlog_then_live_in_order(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16)
    for h in (1, 2, 3):
        pub.publish(stored(h))
    url = await serve(pub)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=1") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/x-msgpack-stream"
        reader = StreamReader(resp)
        got = [await reader.next_batch(), await reader.next_batch()]
        assert [b.seq for b in got] == [2, 3]
        assert got[0].events == (BlockStored((2,), None),)
        for h in (4, 5, 6):
            pub.publish(stored(h))
        live = [await reader.next_batch() for _ in range(3)]
        assert [b.seq for b in live] == [4, 5, 6]
        assert [b.events[0] for b in live] == [BlockStored((h,), None) for h in (4, 5, 6)]
        assert all(b.engine == "e1" for b in live)


async def test_events_endpoint_sends_heartbeats(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16, heartbeat_s=0.05)
    pub.publish(stored(1))
    url = await serve(pub)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=1") as resp:
        reader = StreamReader(resp)
        assert await reader.next() is None  # at once: the headers must not wait for the first batch
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await reader.next(within=1.0) is None
        assert loop.time() - t0 >= 0.03
        pub.publish(stored(2))
        batch = await reader.next_batch()
        assert batch.seq == 2


async def test_events_endpoint_answers_410_when_batches_are_gone(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16, ring_size=3)
    for h in range(5):
        pub.publish(stored(h))
    url = await serve(pub)
    async with aiohttp.ClientSession() as session:
        for after in (0, 1, 6):  # 6: ahead of the engine (it restarted), also a resync
            async with session.get(f"{url}/v1/kv_events?after={after}") as resp:
                assert resp.status == 410, after
                assert resp.headers["x-kv-seq"] == "5"
        async with session.get(f"{url}/v1/kv_events?after=2") as resp:
            assert resp.status == 200
            reader = StreamReader(resp)
            assert [(await reader.next_batch()).seq for _ in range(3)] == [3, 4, 5]


async def test_events_endpoint_checks_the_epoch(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16)
    pub.publish(stored(1))
    url = await serve(pub)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/kv_snapshot") as resp:
            epoch = resp.headers["x-kv-epoch"]
        assert epoch == pub.epoch
        # The same engine: the stream resumes.
        async with session.get(f"{url}/v1/kv_events?after=0&epoch={epoch}") as resp:
            assert resp.status == 200 and resp.headers["x-kv-epoch"] == epoch
            assert (await StreamReader(resp).next_batch()).seq == 1
        # A snapshot from an earlier life of the engine: resync, even though seq 0 exists here.
        async with session.get(f"{url}/v1/kv_events?after=0&epoch=0123456789abcdef") as resp:
            assert resp.status == 410
    assert KvEventPublisher("e1", 16).epoch != pub.epoch


@pytest.mark.parametrize("query", ["", "?after=", "?after=abc", "?after=1.5", "?after=-1"])
async def test_events_endpoint_rejects_a_bad_after(serve: Serve, query: str) -> None:
    pub = KvEventPublisher("e1", 16)
    url = await serve(pub)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events{query}") as resp:
        assert resp.status == 400


async def test_overflowing_stream_is_closed(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16, queue_limit=4)
    url = await serve(pub)
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=0") as resp:
        reader = StreamReader(resp)
        assert await reader.next() is None
        await wait_for(lambda: pub.subscriber_count == 1)
        # Published without yielding to the loop: the stream cannot drain in between.
        for h in range(10):
            pub.publish(stored(h))
        assert pub.subscriber_count == 0
        with pytest.raises(EOFError):
            await reader.next()
    # It reconnects and resyncs from where it was.
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=0") as resp:
        reader = StreamReader(resp)
        assert (await reader.next_batch()).seq == 1


async def test_a_consumer_that_stops_reading_is_cut_off(serve: Serve) -> None:
    pub = KvEventPublisher("e1", 16, queue_limit=4)
    url = await serve(pub)
    big = tuple(range(2**40, 2**40 + 20_000))  # ~180 KB per batch: fills the socket buffers fast
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=0") as resp:
        assert resp.status == 200
        await wait_for(lambda: pub.subscriber_count == 1)
        # The client reads nothing: the stream's writes block, its queue fills, and it is dropped.
        async with asyncio.timeout(10):
            while pub.subscriber_count:
                pub.publish([BlockStored(big, None)])
                await asyncio.sleep(0.001)
        await wait_for(lambda: pub.subscriber_count == 0)


async def test_a_stream_asked_for_once_the_shutdown_began_is_refused() -> None:
    """A stream request read off a keep-alive connection just before the server stopped reaches its
    handler after ``on_shutdown`` ended the streams: a stream opened then is ended by nothing, and the
    server's stop waits out its shutdown timeout for it, twice. It must be refused instead."""
    pub = KvEventPublisher("e1", 16)
    app = web.Application()
    pub.add_routes(app)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    url = await serve_on_free_port(runner)
    try:
        # What the runner's cleanup does before it waits on the open requests; the site still listens
        # here, which stands in for the request that was already read when the stop began.
        await app.shutdown()
        async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/kv_events?after=0") as resp:
            assert resp.status == 503
            assert resp.headers["x-kv-epoch"] == pub.epoch
        assert pub.subscriber_count == 0
    finally:
        await runner.cleanup()
