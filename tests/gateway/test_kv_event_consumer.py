"""The follower of kvgate's own engines' KV events (contract 3), against a small engine over real HTTP."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import msgpack
import pytest
from aiohttp import web

from cache.cancelling import cancel_and_wait
from cache.events import BlockRemoved, BlockStored, KvEventBatch, KvSnapshot
from gateway.state.kv_events import KvEventConsumer
from region_map.config import EngineConfig
from region_map.fleet import EngineState
from tests.harness import MODEL, ClusterFactory


class RecordingSink:
    """The shared state's side of the consumer: what it was told, in order."""

    def __init__(self) -> None:
        self.resyncs: list[tuple[list[int], int]] = []
        self.batches: list[KvEventBatch] = []
        self.applied = asyncio.Event()

    async def apply_events(self, engine: str, batch: KvEventBatch) -> bool:
        self.batches.append(batch)
        self.applied.set()
        return True

    async def resync(self, engine: str, hashes: list[int], seq: int) -> None:
        self.resyncs.append((hashes, seq))


def newer_engine(batches: list[object]) -> web.Application:
    """An engine whose snapshot holds block 1 at seq 0 and whose stream sends ``batches``, then stays open."""

    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=KvSnapshot("e", 0, 16, (1,)).encode())

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for batch in batches:
            await response.write(msgpack.packb(batch))
        await asyncio.sleep(30)  # cancelled when the client leaves (handler_cancellation)
        return response

    app = web.Application()
    app.router.add_get("/v1/kv_snapshot", snapshot)
    app.router.add_get("/v1/kv_events", events)
    return app


async def test_an_event_kind_it_does_not_know_is_skipped_and_the_rest_of_its_batch_applies() -> None:
    # During a rolling upgrade a newer engine may send a kind this gateway does not know; the batch failed
    # whole, and the consumer went back to a snapshot at every batch that carried one.
    events = [["pinned", [1]], ["stored", [5], 1, "trailing"], ["removed", [1], "GPU"]]
    batch = {"engine": "e", "seq": 1, "ts": 1.0, "future_field": True, "events": events}
    runner = web.AppRunner(newer_engine([batch]), handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = EngineConfig.model_validate({"name": "e", "url": f"http://127.0.0.1:{port}", "model": "m"})
    engine = EngineState(id="r/e", region="r", config=config)
    sink = RecordingSink()
    async with aiohttp.ClientSession() as session:
        consumer = KvEventConsumer(engine, session, sink)
        task = asyncio.create_task(consumer.run())
        try:
            await asyncio.wait_for(sink.applied.wait(), 5)
        finally:
            await cancel_and_wait(task)
    await runner.cleanup()
    (applied,) = sink.batches
    assert applied.seq == 1 and applied.events == (BlockStored((5,), 1), BlockRemoved((1,)))
    assert consumer.unknown_events == 1 and consumer.resyncs == 1 and consumer.batches == 1


async def test_its_skipped_events_are_on_the_gateways_metrics_page(make_cluster: ClusterFactory) -> None:
    # The follower of kvgate's own engines counted what it skipped, but nothing exported the count: an
    # operator could not see a rolling upgrade's newer engines, as they can for vLLM and SGLang (source zmq).
    events = [["pinned", [1]], ["stored", [5], 1], ["tiered", [5], "CPU"]]
    engine = newer_engine([{"engine": "e", "seq": 1, "ts": 1.0, "events": events}])

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": MODEL, "block_size": 16, "kv_events": True})

    engine.router.add_get("/health", health)
    cluster = await make_cluster({"eu-west": 0}, extra_engines={"eu-west/e0": engine})
    assert cluster.session is not None
    labels = '{engine="eu-west/e0",region="eu-west",source="kvgate"}'
    # (Its batches applied and its snapshots taken too: they were not exported either.)
    series = [f"kvgate_kv_event_{name}_total{labels} {n}" for name, n in
              (("unknown_events", "2.0"), ("batches", "1.0"), ("resyncs", "1.0"))]  # fmt: skip
    # (Messages refused for their size: the same counter as the ZMQ followers', one follower per engine.)
    series.append('kvgate_kv_event_oversized_messages_total{engine="eu-west/e0",region="eu-west"} 0.0')
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        async with cluster.session.get(cluster.url + "/metrics") as r:
            page = await r.text()
        if all(line in page for line in series):
            break
        assert asyncio.get_running_loop().time() < deadline, page
        await asyncio.sleep(0.05)


async def test_a_message_that_never_ends_is_refused_at_the_size_limit_and_following_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A broken engine announces a 4 GiB string and streams it for ever. The follower buffered up to
    # msgpack's own default (100 MiB), whatever kv_event_max_message_bytes said, then died of BufferFull:
    # the engine was never followed again.
    streamed = 0
    streams = 0

    async def snapshot(request: web.Request) -> web.Response:
        return web.Response(body=KvSnapshot("e", 0, 16, (1,)).encode())

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal streamed, streams
        streams += 1
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"\xdb\xff\xff\xff\xff")  # str 32, 4 GiB long
        chunk = b"x" * (64 << 10)
        while True:  # until the client leaves
            await response.write(chunk)
            streamed += len(chunk)

    app = web.Application()
    app.router.add_get("/v1/kv_snapshot", snapshot)
    app.router.add_get("/v1/kv_events", endless)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = EngineConfig.model_validate({"name": "e", "url": f"http://127.0.0.1:{port}", "model": "m"})
    engine = EngineState(id="r/e", region="r", config=config)
    sink = RecordingSink()
    limit = 1 << 20
    try:
        async with aiohttp.ClientSession() as session:
            consumer = KvEventConsumer(engine, session, sink, max_message_bytes=limit)
            task = asyncio.create_task(consumer.run())
            try:
                deadline = asyncio.get_running_loop().time() + 10
                while streams < 2 or consumer.oversized_messages < 2:  # refused, and asked again
                    assert not task.done(), task.exception()
                    assert asyncio.get_running_loop().time() < deadline, (streams, streamed)
                    await asyncio.sleep(0.01)
            finally:
                await cancel_and_wait(task)
    finally:
        await runner.cleanup()
    assert consumer.resyncs >= 2  # back to a snapshot each time
    said = [r for r in caplog.records if "kv_event_max_message_bytes" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
