"""A block size per engine: engines of 16- and 32-token blocks behind one gateway are both routed precisely.

Before per-engine chains, an engine whose block size differed from the gateway's got every request as a
``miss`` (its hashes never matched the gateway's chain), silently: round robin's hit rate.
"""

from __future__ import annotations

from typing import Any

import pytest

from engine.sim.server import SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from gateway.state.zmq_events import ZmqKvEventConsumer
from tests import vllm_publisher as vp
from tests.conftest import ThirdPartyFleet
from tests.harness import FAST_SIM, MODEL, ClusterFactory


@pytest.mark.parametrize(("gateway_block_size", "length"), [(16, 500), (64, 500), (16, 512)])
async def test_engines_of_two_block_sizes_are_both_routed_by_prefix(
    make_cluster: ClusterFactory, gateway_block_size: int, length: int
) -> None:
    wide = build_sim_app(SimEngineConfig(engine_id="eu-west/b32", model=MODEL, block_size=32, **FAST_SIM))
    cluster = await make_cluster(
        {"eu-west": 1},
        extra_engines={"eu-west/b32": wide},
        engine_options={"eu-west/b32": {"block_size": 32}},
        block_size=gateway_block_size,
    )
    served: dict[str, int] = {}
    for i in range(12):
        # 500 tokens: 31 blocks of 16 (496 tokens), 15 blocks of 32 (480 tokens). 512 tokens are whole
        # blocks of both, and the last one is never cached: its last token is always computed.
        prompt = f"conversation {i:03d} " + "x" * (length - 17)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        status, _, first = await cluster.post("/v1/completions", body)
        assert status == 200
        engine = first["x-kvgate-engine"]
        block = 32 if engine == "eu-west/b32" else 16
        prepare = cluster.gateway.prepare
        chain = prepare.block_hashes(prepare.tokenizer.encode(prompt), MODEL, block_size=block)
        await cluster.wait_for(lambda c=chain, e=engine: cluster.gateway.state.lookup(c).get(e, 0) == len(c))
        status, answer, again = await cluster.post("/v1/completions", body)
        assert status == 200
        assert again["x-kvgate-engine"] == engine and again["x-kvgate-route"] == "prefix"
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (length - 1) // block * block
        assert int(again["x-kvgate-predicted-cached-tokens"]) == cached
        served[engine] = served.get(engine, 0) + 1
    assert set(served) == {"eu-west/e0", "eu-west/b32"}  # new prompts spread over both


@pytest.mark.parametrize("events", [False, True])
async def test_an_sglang_engine_of_one_token_pages_is_routed_in_blocks_of_min_block_size(
    third_party: ThirdPartyFleet, events: bool
) -> None:
    """SGLang's default page of 1 token: the gateway hashes and looks prompts up in 16-token routing blocks
    (a few hundred hashes for a long prompt, not one per token), from its own routing records or from the
    engine's KV events grouped 16 pages to a block; predictions are the engine's hit rounded down to 16."""
    options: dict[str, dict[str, Any]] = {}
    engine: dict[str, Any] = {"kind": "sglang", "block_size": 1, "kv_capacity_blocks": 8192}
    publisher = None
    if events:
        base = vp.free_tcp_ports(2)
        publisher = vp.VllmPublisher(f"tcp://*:{base}", f"tcp://*:{base + 1}", topic="kv-events")
        engine["events"] = publisher
        options["eu-west/s"] = {
            "kv_events_topic": "kv-events",
            "kv_events_endpoint": publisher.endpoint.replace("*", "127.0.0.1"),
            "kv_events_replay_endpoint": (publisher.replay_endpoint or "").replace("*", "127.0.0.1"),
        }
    try:
        cluster, _ = await third_party({"eu-west/s": engine}, engine_options=options)
        followers = [f for f in cluster.gateway.metrics.event_followers if isinstance(f, ZmqKvEventConsumer)]
        assert len(followers) == int(events)
        state = cluster.gateway.state

        def translated() -> set[int]:
            """What the engine's events put in the index: its pages, grouped 16 to a routing block."""
            chain = followers[0].chain if followers else None
            return set(chain.held()) if chain is not None else set()

        for i in range(3):
            prompt = f"agent {i}: " + "a long system prompt, resent every turn. " * (5 + 7 * i)
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
            status, answer, _ = await cluster.post("/v1/completions", body)
            assert status == 200, answer
            tokens = answer["usage"]["prompt_tokens"]
            chain = cluster.gateway.prepare.block_hashes(
                cluster.gateway.prepare.tokenizer.encode(prompt), "tiny", block_size=16
            )
            assert len(chain) == tokens // 16  # one hash per 16 tokens, not per token
            await cluster.wait_for(lambda c=chain: state.lookup(c).get("eu-west/s", 0) == len(c))
            if events:  # exactly the gateway's chain, from the events (not only from its own routing record)
                await cluster.wait_for(lambda c=chain: set(c) <= translated())
            status, answer, again = await cluster.post("/v1/completions", body)
            assert status == 200, answer
            cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            predicted = int(again["x-kvgate-predicted-cached-tokens"])
            assert cached == tokens - 1  # pages of 1: all but the last prompt token
            assert cached - 16 < predicted <= cached and predicted % 16 == 0
        if events:
            assert followers[0].chain is not None and followers[0].chain.routing_block == 16
            assert followers[0].chain.unknown_parent_blocks == 0
    finally:
        if publisher is not None:
            publisher.close()
