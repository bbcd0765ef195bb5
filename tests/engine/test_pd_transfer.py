"""Prefill/decode disaggregation between two real engines over HTTP: the same tokens as one colocated
engine, the same K/V bytes on both sides, only missing blocks on the wire, and clean failures."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from aiohttp import web

from engine.kv_transfer import frame, kv_frame
from engine.sequence import SamplingParams
from tests.engine.kv_nodes import BS, Node, assert_all_free, colocated, complete, prompt, start_node
from tests.serving import serve


@pytest.fixture
async def pd(tiny_model_dir: Path) -> AsyncIterator[tuple[Node, Node, aiohttp.ClientSession]]:
    prefill = await start_node(tiny_model_dir, "prefill", "p0")
    decode = await start_node(tiny_model_dir, "decode", "d0")
    async with aiohttp.ClientSession() as session:
        yield prefill, decode, session
    for node in (prefill, decode):
        await node.runner.cleanup()


async def test_greedy_tokens_equal_a_colocated_engine(pd: Any, tiny_model_dir: Path) -> None:
    prefill, decode, session = pd
    ids = prompt(37)
    status, body, headers = await complete(session, decode, ids, prefill, temperature=0, ignore_eos=True)
    assert status == 200, body
    assert headers["x-kvgate-kv-transfer"] == "remote" and headers["x-kvgate-kv-transferred-tokens"] == "36"
    expected = colocated(tiny_model_dir, ids, SamplingParams(max_tokens=16, temperature=0.0))
    tokenizer = decode.server.llm.tokenizer
    assert body["choices"][0]["text"] == tokenizer.decode(expected)
    assert body["usage"]["completion_tokens"] == len(expected)


async def test_seeded_sampling_equals_a_colocated_engine(pd: Any, tiny_model_dir: Path) -> None:
    prefill, decode, session = pd
    ids = prompt(29, offset=3)
    status, body, _ = await complete(session, decode, ids, prefill, temperature=1.0, top_p=0.9, seed=42)
    assert status == 200, body
    expected = colocated(
        tiny_model_dir, ids, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=42)
    )
    assert body["choices"][0]["text"] == decode.server.llm.tokenizer.decode(expected)


async def test_the_decode_engine_receives_exactly_the_prefill_engines_kv(pd: Any) -> None:
    prefill, decode, session = pd
    ids = prompt(41, offset=7)
    status, _, _ = await complete(session, decode, ids, prefill, max_tokens=1)
    assert status == 200
    p_llm, d_llm = prefill.server.llm, decode.server.llm
    hashes = [h for h in d_llm.blocks.cached_hashes()]
    compared = 0
    for h in hashes:
        p_block = p_llm.blocks._by_hash.get(h)
        d_block = d_llm.blocks._by_hash[h]
        if p_block is None:
            continue  # a block of the answer: computed on the decode engine only
        for layer in range(len(d_llm.kv_cache.k)):
            p_slots = slice(p_block * BS, (p_block + 1) * BS)
            d_slots = slice(d_block * BS, (d_block + 1) * BS)
            assert torch.equal(p_llm.kv_cache.k[layer][p_slots], d_llm.kv_cache.k[layer][d_slots])
            assert torch.equal(p_llm.kv_cache.v[layer][p_slots], d_llm.kv_cache.v[layer][d_slots])
        compared += 1
    assert compared == 40 // BS  # every full block of the 40 transferred positions


async def test_only_the_blocks_the_decode_engine_lacks_travel(pd: Any) -> None:
    prefill, decode, session = pd
    shared = prompt(24, offset=9)
    await complete(session, decode, [*shared, 1], max_tokens=1)  # the decode engine now holds 6 blocks
    before = decode.server.importer.bytes_received
    ids = [*shared, *prompt(13, offset=99)]
    status, body, headers = await complete(session, decode, ids, prefill, max_tokens=2)
    assert status == 200, body
    assert headers["x-kvgate-kv-transferred-tokens"] == str(len(ids) - 1 - 24)
    layers, heads, dim = len(decode.server.llm.kv_cache.k), *decode.server.llm.kv_cache.k[0].shape[1:]
    per_token = 2 * layers * heads * dim * 4
    assert decode.server.importer.bytes_received - before == (len(ids) - 1 - 24) * per_token


async def test_a_dead_prefill_engine_fails_cleanly_and_frees_the_blocks(pd: Any) -> None:
    prefill, decode, session = pd
    await prefill.runner.cleanup()
    status, body, _ = await complete(session, decode, prompt(30), prefill)
    assert status == 502 and body["error"]["code"] == "kv_transfer_failed"
    await assert_all_free(decode)


async def test_a_transfer_cut_short_frees_the_blocks(pd: Any, tiny_model_dir: Path) -> None:
    _, decode, session = pd
    k = torch.zeros(4, *decode.server.llm.kv_cache.k[0].shape[1:])

    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"".join(bytes(memoryview(b)) for b in kv_frame(0, 0, k, k)))
        return response  # ends without the other layers or a done frame

    app = web.Application()
    app.router.add_post("/v1/kv/prefill", broken)
    runner = web.AppRunner(app)
    fake = Node(decode.server, await serve(runner), runner)
    status, body, _ = await complete(session, decode, prompt(30), fake)
    assert status == 502 and "transfer" in body["error"]["message"]
    await assert_all_free(decode)
    await runner.cleanup()
    assert frame({"t": "done"})  # the framing helper itself stays importable for fakes


async def test_the_prefill_endpoint_checks_its_input(pd: Any) -> None:
    prefill, _, session = pd
    base = {
        "model": prefill.server.model,
        "prompt_token_ids": [1, 2, 3],
        "from_position": 0,
        "block_size": BS,
    }
    for bad, status in (({"block_size": 8}, 400), ({"model": "other"}, 404), ({"from_position": 9}, 400)):
        async with session.post(prefill.url + "/v1/kv/prefill", json={**base, **bad}) as r:
            assert r.status == status, await r.text()


async def test_a_fully_cached_pull_is_sent_without_a_model_step(pd: Any) -> None:
    prefill, decode, session = pd
    ids = prompt(33, offset=21)  # the pull covers positions 0..31: eight full blocks of four tokens
    await complete(session, decode, ids, prefill, max_tokens=1)  # the prefill engine now caches them
    steps = []
    run = prefill.server.llm.runner.run

    def counting(batch):  # type: ignore[no-untyped-def]
        steps.append(batch)
        return run(batch)

    prefill.server.llm.runner.run = counting  # type: ignore[method-assign]
    other = await start_node(Path(decode.server.llm.config.model_dir), "decode", "d1")
    try:
        status, body, headers = await complete(session, other, ids, prefill, max_tokens=1)
    finally:
        await other.runner.cleanup()
    assert status == 200, body
    assert headers["x-kvgate-kv-transferred-tokens"] == "32" and steps == []
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
