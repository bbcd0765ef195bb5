"""KV pull between two real engines over HTTP: a target engine takes the K/V of a cached prefix from a peer's
prefix cache (``kv_transfer_params.pull_url``) instead of computing it. The same tokens as computing it all,
only the missing positions on the wire, the peer's copy evicted first afterwards, and a pull that fails (or
finds less than announced) costs the request nothing but the positions it then computes itself."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from engine.kv_export import ExportSink
from engine.kv_transfer import CONTENT_TYPE, KvChunk, frame, kv_frame, read_frame
from engine.llm_engine import EngineConfig, LLMEngine
from engine.openai_errors import MAX_BODY_BYTES
from engine.scheduler import ScheduledSeq
from engine.sequence import CacheNamespace, SamplingParams
from tests.engine.kv_nodes import (
    BS,
    Node,
    assert_all_free,
    colocated,
    complete,
    engine_metrics,
    prompt,
    start_node,
)
from tests.serving import serve

GREEDY: dict[str, Any] = {"temperature": 0, "ignore_eos": True}

Pair = tuple[Node, Node, aiohttp.ClientSession]


@pytest.fixture
async def pair(tiny_model_dir: Path) -> AsyncIterator[Pair]:
    """``source`` holds prefixes in its cache, ``target`` pulls them."""
    source = await start_node(tiny_model_dir, "both", "src")
    target = await start_node(tiny_model_dir, "both", "dst")
    async with aiohttp.ClientSession() as session:
        yield source, target, session
    for node in (source, target):
        await node.runner.cleanup()


def pull_params(node: Node | str, tokens: int) -> dict[str, Any]:
    url = node if isinstance(node, str) else node.url
    return {"kv_transfer_params": {"pull_url": url, "pull_engine": "src", "pull_tokens": tokens}}


def count_prefill(node: Node) -> list[int]:
    """Prompt positions the node's model computes from now on (one entry per step that computed any)."""
    computed: list[int] = []
    run = node.server.llm.runner.run

    def counting(batch: list[ScheduledSeq]) -> torch.Tensor:
        n = sum(i.num_new for i in batch if i.seq.num_computed < i.seq.num_prompt_tokens)
        if n:
            computed.append(n)
        return run(batch)

    node.server.llm.runner.run = counting  # type: ignore[method-assign]
    return computed


def block_ids(llm: LLMEngine, ids: list[int], namespace: CacheNamespace | None = None) -> list[int]:
    """The blocks of ``llm``'s prefix cache holding the full blocks of ``ids``, in prefix order."""
    seq = llm._sequence("probe", ids, SamplingParams(), namespace or CacheNamespace())
    return [llm.blocks._by_hash[h] for h in seq.block_hashes(BS) if h in llm.blocks._by_hash]


def expected_text(model_dir: Path, node: Node, ids: list[int], **sampling: Any) -> str:
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **sampling)
    return node.server.llm.tokenizer.decode(colocated(model_dir, ids, params))


async def test_a_pull_gives_the_same_tokens_computes_only_the_rest_and_migrates_the_blocks(
    pair: Pair, tiny_model_dir: Path
) -> None:
    source, target, session = pair
    await complete(session, source, prompt(13, offset=70), max_tokens=1)  # older: evicted first, until...
    shared = prompt(33)  # the source caches its first 8 blocks (32 positions)
    assert (await complete(session, source, shared, max_tokens=1))[0] == 200
    ids = [*shared, *prompt(8, offset=50)]  # a continuation: 41 tokens, the first 32 cached at the source
    computed = count_prefill(target)
    status, body, headers = await complete(session, target, ids, **GREEDY, **pull_params(source, 32))
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(tiny_model_dir, target, ids)
    assert headers["x-kvgate-kv-transfer"] == "pull" and headers["x-kvgate-kv-transferred-tokens"] == "32"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert sum(computed) == 41 - 32  # the target computed only what the pull did not bring

    # The pulled K/V is the source's, byte for byte, and now in the target's prefix cache.
    s_llm, t_llm = source.server.llm, target.server.llm
    s_blocks, t_blocks = block_ids(s_llm, shared), block_ids(t_llm, shared)
    assert len(s_blocks) == len(t_blocks) == 8
    for s_block, t_block in zip(s_blocks, t_blocks, strict=True):
        s_slots, t_slots = slice(s_block * BS, (s_block + 1) * BS), slice(t_block * BS, (t_block + 1) * BS)
        for layer in range(len(t_llm.kv_cache.k)):
            assert torch.equal(s_llm.kv_cache.k[layer][s_slots], t_llm.kv_cache.k[layer][t_slots])
            assert torch.equal(s_llm.kv_cache.v[layer][s_slots], t_llm.kv_cache.v[layer][t_slots])
    # ...the pull: the source gives its copy up first, tail block first, though it is the newer one.
    assert list(s_llm.blocks._evictable)[:8] == s_blocks[::-1]

    target_metrics = await engine_metrics(session, target.url)
    source_metrics = await engine_metrics(session, source.url)
    assert target_metrics['kvgate_engine_kv_pulls_total{outcome="ok"}'] == 1
    assert target_metrics['kvgate_engine_kv_pulls_total{outcome="failed"}'] == 0
    assert target_metrics["kvgate_engine_kv_pulled_tokens_total"] == 32
    assert source_metrics["kvgate_engine_kv_pull_served_total"] == 1
    assert source_metrics["kvgate_engine_kv_pull_served_tokens_total"] == 32
    async with session.get(target.url + "/health") as r:
        assert (await r.json())["kv_pull"] is True


async def test_only_what_the_target_lacks_travels_and_is_demoted(pair: Pair, tiny_model_dir: Path) -> None:
    source, target, session = pair
    ids = prompt(37, offset=4)
    await complete(session, source, prompt(13, offset=70), max_tokens=1)  # older than ids: evicted first
    await complete(session, source, ids, max_tokens=1)  # 9 blocks cached at the source
    await complete(session, target, ids[:9], max_tokens=1)  # the target already holds the first 2 itself
    before = target.server.importer.bytes_received
    computed = count_prefill(target)
    status, body, headers = await complete(session, target, ids, **GREEDY, **pull_params(source, 36))
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(tiny_model_dir, target, ids)
    assert headers["x-kvgate-kv-transferred-tokens"] == str(36 - 8) and sum(computed) == 1
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 36  # its own 8 + 28 pulled
    cache = target.server.llm.kv_cache
    per_position = 2 * len(cache.k) * cache.k[0][0].numel() * cache.k[0].element_size()  # K and V, all layers
    assert target.server.importer.bytes_received - before == 28 * per_position
    s_blocks = block_ids(source.server.llm, ids)
    evictable = list(source.server.llm.blocks._evictable)
    assert evictable[:7] == s_blocks[2:][::-1]  # the 7 blocks sent go first...
    assert evictable[-2:] == [s_blocks[1], s_blocks[0]]  # ...the 2 the target had keep their place


async def test_a_peer_holding_less_than_announced_sends_what_it_has(pair: Pair, tiny_model_dir: Path) -> None:
    source, target, session = pair
    ids = prompt(33, offset=8)
    await complete(session, source, ids[:17], max_tokens=1)  # only 4 of the 8 announced blocks are there
    computed = count_prefill(target)
    sampling: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "seed": 42, "ignore_eos": True}
    status, body, headers = await complete(session, target, ids, **sampling, **pull_params(source, 32))
    assert status == 200, body
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    expected = target.server.llm.tokenizer.decode(colocated(tiny_model_dir, ids, params))
    assert body["choices"][0]["text"] == expected
    assert headers["x-kvgate-kv-transferred-tokens"] == "16" and sum(computed) == 33 - 16
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
    m = await engine_metrics(session, target.url)
    assert m['kvgate_engine_kv_pulls_total{outcome="partial"}'] == 1
    assert m["kvgate_engine_kv_pulled_tokens_total"] == 16


async def test_no_pull_when_the_targets_own_cache_covers_it(pair: Pair, tiny_model_dir: Path) -> None:
    _, target, session = pair
    ids = prompt(25, offset=12)
    await complete(session, target, ids, max_tokens=1)
    status, body, headers = await complete(session, target, ids, **GREEDY, **pull_params(closed_url(), 24))
    assert status == 200, body
    assert body["choices"][0]["text"] == expected_text(tiny_model_dir, target, ids)
    assert headers["x-kvgate-kv-transfer"] == "pull" and headers["x-kvgate-kv-transferred-tokens"] == "0"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 24
    assert sum(target.server.llm.counters.kv_pulls.values()) == 0  # nothing was even attempted


def closed_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _bytes(buffers: list[Any]) -> bytes:
    return b"".join(bytes(memoryview(b)) for b in buffers)


def _kv(start: int, count: int, heads: int = 2, dim: int = 16, layer: int = 0) -> bytes:
    k = torch.full((count, heads, dim), 7.0)
    return _bytes(kv_frame(layer, start, k, k))


async def _status_500(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": {"message": "boom"}}, status=500)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _streaming(*chunks: bytes) -> Handler:
    """A fake source that answers 200 with these bytes, then ends the stream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = CONTENT_TYPE
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
        return response

    return handler


FAULTS: dict[str, Handler] = {
    "500": _status_500,
    # One layer of four positions, then the stream ends: the other layer never comes.
    "cut short": _streaming(_kv(0, 4)),
    "error frame": _streaming(_kv(0, 4), _bytes(frame({"t": "error", "message": "engine died"}))),
    # Every layer, then a done frame announcing more positions than arrived.
    "lying done": _streaming(
        _kv(0, 4), _kv(0, 4, layer=1), _bytes(frame({"t": "done", "tokens": 8, "cached_tokens": 8}))
    ),
    "wrong shape": _streaming(_kv(0, 4, heads=3)),
    "garbage": _streaming(b"\xff\xff\xff\xff not a frame"),
}


@pytest.mark.parametrize("fault", ["closed port", *FAULTS])
async def test_a_failed_pull_is_computed_here_and_the_request_succeeds(
    pair: Pair, tiny_model_dir: Path, fault: str
) -> None:
    _, target, session = pair
    runner = None
    url = closed_url()
    if fault != "closed port":
        app = web.Application()
        app.router.add_post("/v1/kv/cached", FAULTS[fault])
        runner = web.AppRunner(app)
        url = await serve(runner)
    try:
        ids = prompt(30, offset=17)
        status, body, headers = await complete(session, target, ids, **GREEDY, **pull_params(url, 28))
    finally:
        if runner is not None:
            await runner.cleanup()
    assert status == 200, body
    # Whatever the broken pull had written into the blocks was computed over: the same tokens.
    assert body["choices"][0]["text"] == expected_text(tiny_model_dir, target, ids)
    assert headers["x-kvgate-kv-transfer"] == "pull" and headers["x-kvgate-kv-transferred-tokens"] == "0"
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    m = await engine_metrics(session, target.url)
    assert m['kvgate_engine_kv_pulls_total{outcome="failed"}'] == 1
    assert m["kvgate_engine_kv_pulled_tokens_total"] == 0
    await assert_all_free(target)


async def test_pull_parameters_are_checked(pair: Pair) -> None:
    _, target, session = pair
    good = {"pull_url": "http://127.0.0.1:1", "pull_tokens": 4}
    for bad in (
        "http://peer",
        {**good, "pull_url": "ftp://peer"},
        {**good, "pull_url": 3},
        {**good, "pull_tokens": -1},
        {**good, "pull_tokens": True},
        {**good, "pull_tokens": "4"},
        {"pull_url": "http://127.0.0.1:1"},
        {**good, "pull_engine": 7},
        {**good, "prefill_url": "http://127.0.0.1:2"},
    ):
        status, body, _ = await complete(session, target, prompt(9), kv_transfer_params=bad)
        assert status == 400, (bad, body)
        assert body["error"]["param"] == "kv_transfer_params", body
        assert body["error"]["type"] == "invalid_request_error"


async def test_the_cached_endpoint_checks_its_input(pair: Pair) -> None:
    source, _, session = pair
    base = {"model": source.server.model, "prompt_token_ids": [1, 2, 3], "from_position": 0, "block_size": BS}
    for bad, status in (
        ({"block_size": 8}, 400),
        ({"model": "other"}, 404),
        ({"from_position": 3}, 400),
        ({"from_position": -1}, 400),
        ({"from_position": "0"}, 400),
        ({"prompt_token_ids": []}, 400),
        ({"prompt_token_ids": "abc"}, 400),
    ):
        async with session.post(source.url + "/v1/kv/cached", json={**base, **bad}) as r:
            body = await r.json(content_type=None)
            assert r.status == status, (bad, body)
            assert body["error"]["message"], body
    async with session.post(source.url + "/v1/kv/cached", data=b"{") as r:
        assert r.status == 400
    # A prompt longer than the context is refused before its ids are converted or hashed (millions of them
    # held up the engine's event loop), on both KV source routes.
    limit = source.server.info.max_model_len
    for path in ("/v1/kv/cached", "/v1/kv/prefill"):
        async with session.post(source.url + path, json={**base, "prompt_token_ids": [1] * (limit + 1)}) as r:
            body = await r.json(content_type=None)
            assert r.status == 400, (path, body)
            assert body["error"]["param"] == "prompt_token_ids", body
            assert body["error"]["code"] == "context_length_exceeded", body
    # A body over the limit: OpenAI's JSON error, as on /v1/completions, not aiohttp's text/plain 413.
    for path in ("/v1/kv/cached", "/v1/kv/prefill"):
        async with session.post(source.url + path, data=b" " * (MAX_BODY_BYTES + 1)) as r:
            assert (r.status, r.content_type) == (413, "application/json"), path
            assert str(MAX_BODY_BYTES) in (await r.json())["error"]["message"]
    await assert_all_free(source)


async def _pull_frames(session: aiohttp.ClientSession, node: Node, ids: list[int], start: int) -> list[Any]:
    body = {
        "model": node.server.model,
        "prompt_token_ids": ids,
        "from_position": start,
        "block_size": BS,
        "cache_salt": "",
        "cache_shared_blocks": 0,
        "request_id": "probe",
    }
    async with session.post(node.url + "/v1/kv/cached", json=body) as r:
        assert r.status == 200 and r.content_type == CONTENT_TYPE
        frames = [await read_frame(r.content)]
        while isinstance(frames[-1], KvChunk):
            frames.append(await read_frame(r.content))
        return frames


async def test_the_cached_endpoint_sends_what_is_cached_then_says_how_far(pair: Pair) -> None:
    source, _, session = pair
    ids = prompt(14, offset=31)
    await complete(session, source, ids, max_tokens=1)  # 3 full blocks cached: positions 0..11
    frames = await _pull_frames(session, source, ids, 4)
    layers = len(source.server.llm.kv_cache.k)
    assert [(f.layer, f.start, f.k.shape[0]) for f in frames[:-1]] == [(i, 4, 8) for i in range(layers)]
    assert frames[-1] == {"t": "done", "tokens": 12, "cached_tokens": 12}
    # A prompt the source never saw: only the done frame, at from_position.
    assert await _pull_frames(session, source, prompt(14, offset=99), 4) == [
        {"t": "done", "tokens": 4, "cached_tokens": 4}
    ]


async def test_a_pull_is_served_while_requests_wait(tiny_model_dir: Path) -> None:
    # One sequence at a time: a long generation runs and the others wait behind it for many steps.
    source = await start_node(tiny_model_dir, "both", "busy", max_num_seqs=1, num_kv_blocks=1024)
    try:
        async with aiohttp.ClientSession() as session:
            ids = prompt(21, offset=40)
            await complete(session, source, ids, max_tokens=1)
            long: dict[str, Any] = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
            busy = [
                asyncio.create_task(complete(session, source, prompt(8, offset=i), **long)) for i in range(4)
            ]
            scheduler = source.server.llm.scheduler
            for _ in range(200):
                if len(scheduler.waiting) == 3:
                    break
                await asyncio.sleep(0.01)
            assert len(scheduler.waiting) == 3 and len(scheduler.running) == 1
            frames = await _pull_frames(session, source, ids, 0)
            # Served, and the requests that were queued before it still wait: it did not queue behind them.
            assert frames[-1] == {"t": "done", "tokens": 20, "cached_tokens": 20}
            assert len(scheduler.waiting) == 3
            for task in busy:
                task.cancel()
            for task in busy:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await assert_all_free(source)
    finally:
        await source.runner.cleanup()


def test_the_engine_serves_a_cached_export_between_steps(tiny_model_dir: Path) -> None:
    """At the engine level: the export is answered at once, whatever the scheduler holds, computes nothing
    and tells the gateway nothing (the blocks are still cached)."""
    llm = LLMEngine(EngineConfig(str(tiny_model_dir), block_size=BS, num_kv_blocks=64, device="cpu"))
    ids = prompt(13, offset=3)
    llm.generate([ids], SamplingParams(max_tokens=1))
    for i in range(5):
        llm.add_request(f"w{i}", prompt(9, offset=i), SamplingParams(max_tokens=4))
    llm.blocks.drain_events()
    sent: list[list[Any]] = []
    closed: list[dict[str, Any]] = []
    assert llm.export_cached(ids, CacheNamespace(), 0, ExportSink(sent.append, closed.append)) == 12
    assert len(sent) == len(llm.kv_cache.k) and closed == [{"t": "done", "tokens": 12, "cached_tokens": 12}]
    assert len(llm.scheduler.waiting) == 5 and not llm.scheduler.running  # nothing was scheduled for it
    assert llm.blocks.drain_events() == []
