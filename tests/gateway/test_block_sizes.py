"""A block size per engine: engines of 16- and 32-token blocks behind one gateway are both routed precisely.

Before per-engine chains, an engine whose block size differed from the gateway's got every request as a
``miss`` (its hashes never matched the gateway's chain), silently: round robin's hit rate.
"""

from __future__ import annotations

import pytest

from engine.sim.server import SimEngineConfig
from engine.sim.server import build_app as build_sim_app
from tests.harness import FAST_SIM, MODEL, ClusterFactory


@pytest.mark.parametrize("gateway_block_size", [16, 64])
async def test_engines_of_two_block_sizes_are_both_routed_by_prefix(
    make_cluster: ClusterFactory, gateway_block_size: int
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
        # 500 tokens: 31 blocks of 16 (496 tokens), 15 blocks of 32 (480 tokens).
        prompt = f"conversation {i:03d} " + "x" * (500 - 17)
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
        assert cached == 500 // block * block
        assert int(again["x-kvgate-predicted-cached-tokens"]) == cached
        served[engine] = served.get(engine, 0) + 1
    assert set(served) == {"eu-west/e0", "eu-west/b32"}  # new prompts spread over both
