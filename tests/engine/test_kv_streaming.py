"""How K/V moves between engines: the forward pass only stages it (no host sync on the KV tensors), a slow
receiver holds the sender back within its window without a deadlock, an aborted transfer gives back every
buffer and block it held, and the receiving side stores K/V off the event loop, from any chunking of the
stream."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from engine import kv_import, kv_staging, model_runner
from engine.async_engine import AsyncEngine
from engine.attention import KVCache
from engine.kv_export import ExportSink, layer_sender
from engine.kv_import import KvImporter
from engine.kv_transfer import CONTENT_TYPE, StagedFrame, frame, kv_frame
from engine.kv_wire import LENGTH_BYTES, header_length, parse_header
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import CacheNamespace, SamplingParams
from tests.engine.kv_nodes import BS, Node, assert_all_free, complete, prompt, start_node
from tests.serving import serve


def engine(model_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), block_size=BS, num_kv_blocks=128, device="cpu"))


def kv(llm: LLMEngine) -> KVCache:
    assert llm.kv_cache is not None
    return llm.kv_cache


def importer(node: Node) -> KvImporter:
    assert node.server.importer is not None
    return node.server.importer


def opened(f: StagedFrame) -> tuple[dict[str, Any], bytes]:
    """A frame's header and a copy of its payload (its buffers are reused once it is released)."""
    header = parse_header(f.head[LENGTH_BYTES:])
    assert header_length(f.head[:LENGTH_BYTES]) == len(f.head) - LENGTH_BYTES
    return header, b"".join(bytes(p) for p in f.payload)


def cached_rows(llm: LLMEngine, layer: int, ids: list[int], start: int, count: int) -> bytes:
    """K then V of positions ``start .. start + count`` of ``ids``, as this engine's cache holds them."""
    seq = llm._sequence("probe", ids, SamplingParams(), CacheNamespace())
    seq.export = ExportSink(lambda f: None, lambda h: None)
    table = llm.blocks.match_prefix(seq)
    slots = [table[p // BS] * BS + p % BS for p in range(start, start + count)]
    k, v = kv(llm).layer(layer)
    return b"".join(t[slots].contiguous().view(torch.uint8).numpy().tobytes() for t in (k, v))


def layer_bytes(got: list[tuple[dict[str, Any], bytes]], layer: int) -> bytes:
    """One layer's K, then V, from its frames (each carries its positions' K then V)."""
    parts = sorted((h["start"], p) for h, p in got if h.get("layer") == layer)
    return b"".join(p[: len(p) // 2] for _, p in parts) + b"".join(p[len(p) // 2 :] for _, p in parts)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    assert condition()


# -- the sending side -------------------------------------------------------------------------------------


def test_the_forward_pass_only_stages_the_kv_and_never_syncs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = engine(tiny_model_dir)
    kv_storages = {t.untyped_storage().data_ptr() for t in (*kv(llm).k, *kv(llm).v)}
    synced: list[str] = []
    hooks: list[int] = []
    in_hook = threading.local()

    def spy(name: str) -> Callable[..., Any]:
        real = getattr(torch.Tensor, name)

        def call(self: torch.Tensor, *args: Any) -> Any:
            # Anything the per-layer hook reads back to the host, or anyone on the cache itself.
            if getattr(in_hook, "on", False) or self.untyped_storage().data_ptr() in kv_storages:
                synced.append(name)
            return real(self, *args)

        return call

    for name in ("cpu", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, spy(name))

    def watched(*args: Any) -> Callable[[int], None]:
        hook = layer_sender(*args)

        def on_layer(i: int) -> None:
            hooks.append(i)
            in_hook.on = True
            try:
                hook(i)
            finally:
                in_hook.on = False

        return on_layer

    monkeypatch.setattr(model_runner, "layer_sender", watched)
    sent: list[tuple[dict[str, Any], bytes]] = []
    staged: list[StagedFrame] = []
    closed: list[dict[str, Any]] = []

    def send(f: StagedFrame) -> None:
        staged.append(f)
        sent.append(opened(f))

    ids = prompt(24, offset=5)
    llm.add_export("export", ids, CacheNamespace(), 4, ExportSink(send, closed.append))
    while llm.has_work():
        llm.step()
    assert synced == []  # no .cpu(), .item() or .tolist() on the K/V: nothing waits for the device
    layers = len(kv(llm).k)
    assert hooks == list(range(layers))  # one step, and the hook staged each layer as it finished
    assert [(h["layer"], h["start"], h["count"]) for h, _ in sent] == [(i, 4, 20) for i in range(layers)]
    assert closed == [{"t": "done", "tokens": 24, "cached_tokens": 0}]
    # Each frame is a copy taken as its layer finished: what the cache held, and unchanged since.
    for i, (_, payload) in enumerate(sent):
        assert payload == cached_rows(llm, i, ids, 4, 20)
    for t in (*kv(llm).k, *kv(llm).v):
        t.zero_()
    assert [b"".join(bytes(p) for p in f.payload) for f in staged] == [p for _, p in sent]


async def started(llm: LLMEngine, window: int) -> AsyncEngine:
    llm.kv_frame_bytes = 1  # a frame per position: many frames, and a window that fills at once
    async_engine = AsyncEngine(llm, kv_send_window=window)
    async_engine.start()
    return async_engine


async def test_a_slow_receiver_holds_the_export_back_within_its_window(tiny_model_dir: Path) -> None:
    llm = engine(tiny_model_dir)
    async_engine = await started(llm, window=2)
    ids = prompt(32, offset=9)
    got: list[tuple[dict[str, Any], bytes]] = []
    held: list[StagedFrame] = []
    try:
        frames = async_engine.export("slow", ids, CacheNamespace(), 0)
        async with contextlib.aclosing(frames):
            async for f in frames:
                got.append(opened(f))
                held.append(f)
                window = next(iter(async_engine._windows))
                assert window.in_flight <= 2
                if len(got) == 2:
                    # The receiver keeps both: the step waits for room, it stages nothing more.
                    await asyncio.sleep(0.1)
                    assert window.in_flight == 2 and async_engine.steps == 0 and llm.scheduler.running
                if len(held) == 2:
                    held.pop(0).release()
        for f in held:
            f.release()
        assert window.peak == 2
        layers = len(kv(llm).k)
        assert got[-1][0] == {"t": "done", "tokens": 32, "cached_tokens": 0}
        shapes = [(h["layer"], h["start"], h["count"]) for h, _ in got[:-1]]
        assert sorted(shapes) == [(i, p, 1) for i in range(layers) for p in range(32)]
        for layer in range(layers):
            assert layer_bytes(got, layer) == cached_rows(llm, layer, ids, 0, 32)
        assert llm.kv_buffers.outstanding == 0
    finally:
        await async_engine.stop()


async def test_aborting_an_export_mid_transfer_frees_what_it_held(tiny_model_dir: Path) -> None:
    llm = engine(tiny_model_dir)
    async_engine = await started(llm, window=2)
    try:
        frames = async_engine.export("gone", prompt(30, offset=3), CacheNamespace(), 0)
        first = await anext(frames)
        await asyncio.sleep(0.1)
        window = next(iter(async_engine._windows))
        assert window.in_flight == 2 and llm.kv_buffers.outstanding == 2  # the step waits for room
        await frames.aclose()  # the receiver left
        assert window.closed
        first.release()
        # The step goes on without staging more, the export is aborted, nothing is left held.
        await until(lambda: not llm.scheduler.has_work() and window.in_flight == 0)
        assert llm.kv_buffers.outstanding == 0
        assert all(b.ref_count == 0 for b in llm.blocks.blocks)
        outputs = [o async for o in async_engine.generate("after", prompt(9), SamplingParams(max_tokens=3))]
        assert outputs[-1].finished  # the engine serves on
    finally:
        await async_engine.stop()


async def test_a_pull_holds_its_blocks_until_sent_and_gives_them_back_when_aborted(
    tiny_model_dir: Path,
) -> None:
    llm = engine(tiny_model_dir)
    ids = prompt(33, offset=11)
    llm.generate([ids], SamplingParams(max_tokens=1))  # 8 full blocks cached
    async_engine = await started(llm, window=2)
    try:
        frames = async_engine.export_cached("pull", ids, CacheNamespace(), 0)
        first = await anext(frames)
        assert sum(b.ref_count for b in llm.blocks.blocks) == 8  # held for the transfer, nothing copied yet
        assert async_engine.steps == 0  # served without a step, and without waiting for the receiver
        await frames.aclose()
        first.release()
        await until(lambda: all(b.ref_count == 0 for b in llm.blocks.blocks))
        assert llm.blocks.num_cached >= 8  # given back, still cached
        assert llm.kv_buffers.outstanding == 0

        # A whole pull: every frame, then the done frame; the blocks go back once the last one is released.
        got = []
        async with contextlib.aclosing(async_engine.export_cached("pull2", ids, CacheNamespace(), 4)) as pull:
            async for f in pull:
                got.append(opened(f))
                f.release()
        assert got[-1][0] == {"t": "done", "tokens": 32, "cached_tokens": 32}
        for layer in range(len(kv(llm).k)):
            assert layer_bytes(got, layer) == cached_rows(llm, layer, ids, 4, 28)
        await until(lambda: all(b.ref_count == 0 for b in llm.blocks.blocks))
    finally:
        await async_engine.stop()


# -- the receiving side -----------------------------------------------------------------------------------


def _stream(layers: int, heads: int, dim: int, count: int) -> bytes:
    """A whole pull of ``count`` positions: every layer's K (layer + 1) and V (-(layer + 1)), then done."""
    parts = []
    for layer in range(layers):
        k = torch.full((count, heads, dim), layer + 1.0)
        parts.append(b"".join(bytes(memoryview(b)) for b in kv_frame(layer, 0, k, -k)))
    parts.append(
        b"".join(bytes(memoryview(b)) for b in frame({"t": "done", "tokens": count, "cached_tokens": count}))
    )
    return b"".join(parts)


def _source(body: bytes, chunk: int | None, stall: bool = False) -> Callable[[web.Request], Any]:
    """A fake peer answering a pull with ``body``, in HTTP chunks of ``chunk`` bytes (None: one body with a
    content-length); ``stall``: half of it, then nothing."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if chunk is None:
            return web.Response(body=body, content_type=CONTENT_TYPE)
        response = web.StreamResponse()
        response.content_type = CONTENT_TYPE
        await response.prepare(request)
        end = len(body) // 2 if stall else len(body)
        for i in range(0, end, chunk):
            await response.write(body[i : min(i + chunk, end)])
        if stall:
            await asyncio.sleep(60)
        return response

    return handler


@pytest.mark.parametrize("chunk", [7, 4096, None], ids=["7-byte chunks", "4 KiB chunks", "content-length"])
async def test_the_receiver_stores_the_kv_off_the_loop_however_the_stream_is_cut(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, chunk: int | None
) -> None:
    target = await start_node(tiny_model_dir, "both", "dst")
    cache = kv(target.server.llm)
    layers, (heads, dim) = len(cache.k), cache.k[0].shape[1:]
    app = web.Application()
    app.router.add_post("/v1/kv/cached", _source(_stream(layers, heads, dim, 20), chunk))
    runner = web.AppRunner(app)
    url = await serve(runner)
    threads: set[str] = set()
    read_rows = kv_import._Staging.read_rows

    def spy(self: Any, *args: Any) -> None:
        threads.add(threading.current_thread().name)
        read_rows(self, *args)

    monkeypatch.setattr(kv_import._Staging, "read_rows", spy)
    try:
        async with aiohttp.ClientSession() as session:
            ids = prompt(21, offset=40)
            pull = {"pull_url": url, "pull_tokens": 20}
            status, body, headers = await complete(
                session, target, ids, kv_transfer_params=pull, max_tokens=1
            )
        assert status == 200, body
        assert headers["x-kvgate-kv-transferred-tokens"] == "20"
        assert threads and threading.current_thread().name not in threads  # a worker, never the loop's
        llm = target.server.llm
        for layer in range(layers):
            rows = cached_rows(llm, layer, ids, 0, 20)
            half = len(rows) // 2
            k, v = (torch.frombuffer(bytearray(r), dtype=torch.float32) for r in (rows[:half], rows[half:]))
            assert bool((k == layer + 1).all()) and bool((v == -(layer + 1)).all())
        assert importer(target).buffers.outstanding == 0
    finally:
        await runner.cleanup()
        await target.runner.cleanup()


async def test_a_request_that_leaves_mid_pull_frees_its_blocks_once_the_worker_stopped(
    tiny_model_dir: Path,
) -> None:
    target = await start_node(tiny_model_dir, "both", "dst")
    cache = kv(target.server.llm)
    layers, (heads, dim) = len(cache.k), cache.k[0].shape[1:]
    app = web.Application()
    app.router.add_post("/v1/kv/cached", _source(_stream(layers, heads, dim, 20), 64, stall=True))
    runner = web.AppRunner(app, handler_cancellation=True)
    url = await serve(runner)
    stores = 0
    read_rows = kv_import._Staging.read_rows

    def counting(self: Any, *args: Any) -> None:
        nonlocal stores
        read_rows(self, *args)
        stores += 1

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kv_import._Staging, "read_rows", counting)
            async with aiohttp.ClientSession() as session:
                pull = {"pull_url": url, "pull_tokens": 20}
                request = complete(session, target, prompt(21, offset=60), kv_transfer_params=pull)
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(request, 1.0)  # the client gives up while the pull stalls
            await assert_all_free(target)
            assert stores  # it was mid-transfer: the first layer had been stored
            assert importer(target).buffers.outstanding == 0
    finally:
        await runner.cleanup()
        await target.runner.cleanup()


async def test_a_receiver_that_stops_reading_holds_the_step_no_longer_than_the_window_timeout(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_staging, "SEND_STALL_TIMEOUT_S", 0.2)
    llm = engine(tiny_model_dir)
    async_engine = await started(llm, window=2)
    try:
        frames = async_engine.export("stalled", prompt(30, offset=5), CacheNamespace(), 0)
        held = [await anext(frames), await anext(frames)]  # the receiver takes two frames, then stops
        window = next(iter(async_engine._windows))
        last = await asyncio.wait_for(anext(frames), 5.0)  # the step gave up on it after 0.2 s
        assert parse_header(last.head[LENGTH_BYTES:]) == {
            "t": "error",
            "message": "the receiving engine took no K/V for 0.2 s",
        }
        with pytest.raises(StopAsyncIteration):
            await anext(frames)
        assert window.stalled
        for f in held:
            f.release()
        await until(lambda: not llm.scheduler.has_work())  # aborted: its blocks went back
        assert all(b.ref_count == 0 for b in llm.blocks.blocks)
        assert llm.kv_buffers.outstanding == 0
        outputs = [o async for o in async_engine.generate("after", prompt(9), SamplingParams(max_tokens=3))]
        assert outputs[-1].finished  # the engine serves on
    finally:
        await async_engine.stop()
