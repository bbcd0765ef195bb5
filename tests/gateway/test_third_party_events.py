"""The whole path with vLLM-style KV events: stand-in vLLM engines publish over ZMQ in vLLM's framing, the
gateway follows them, and every request's predicted cached tokens equal what the engine then reports:
through evictions, a cache reset and an engine restart.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.state.zmq_events import ZmqKvEventConsumer
from tests import vllm_publisher as vp
from tests.conftest import ThirdPartyFleet
from tests.harness import Cluster
from tests.third_party_engines import BlockPool, VllmLikeEngine, vllm_hash_id

ENGINES = ("eu-west/v0", "eu-west/v1")


@pytest.fixture
def publishers() -> Iterator[dict[str, vp.VllmPublisher]]:
    base = vp.free_tcp_ports(2 * len(ENGINES))
    ports = range(base, base + 2 * len(ENGINES))
    out = {
        engine_id: vp.VllmPublisher(
            f"tcp://*:{ports[2 * i]}", f"tcp://*:{ports[2 * i + 1]}", topic="kv-events"
        )
        for i, engine_id in enumerate(ENGINES)
    }
    yield out
    for p in out.values():
        p.close()


async def fleet(
    third_party: ThirdPartyFleet, publishers: dict[str, vp.VllmPublisher], capacity: int
) -> tuple[Cluster, dict[str, VllmLikeEngine]]:
    options = {
        engine_id: {
            "model": None, "block_size": None, "kv_events_topic": "kv-events",
            "kv_events_endpoint": p.endpoint.replace("*", "127.0.0.1"),
            "kv_events_replay_endpoint": (p.replay_endpoint or "").replace("*", "127.0.0.1"),
        }
        for engine_id, p in publishers.items()
    }  # fmt: skip
    cluster, engines = await third_party(
        {i: {"events": publishers[i], "kv_capacity_blocks": capacity, "block_size": 32} for i in ENGINES},
        engine_options=options,
    )
    await cluster.wait_for(lambda: all(f.ready.is_set() for f in followers(cluster)))
    return cluster, engines


def followers(cluster: Cluster) -> list[ZmqKvEventConsumer]:
    return [f for f in cluster.gateway.metrics.event_followers if isinstance(f, ZmqKvEventConsumer)]


async def caught_up(cluster: Cluster, publishers: dict[str, vp.VllmPublisher]) -> None:
    """Every batch the engines published has been applied (events are asynchronous by design)."""
    by_engine = {f.engine.id: f for f in followers(cluster)}

    def done() -> bool:
        return all(
            p.next_seq == 0 or by_engine[i].last_seq(0) == p.next_seq - 1 for i, p in publishers.items()
        )

    await cluster.wait_for(done)


async def ask(cluster: Cluster, prompt: str, **headers: str) -> tuple[int, int, str]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    status, answer, h = await cluster.post("/v1/completions", body, headers=headers or None)
    assert status == 200, answer
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return int(h["x-kvgate-predicted-cached-tokens"]), cached, h["x-kvgate-engine"]


async def test_predictions_equal_the_engines_cached_tokens_through_evictions(
    third_party: ThirdPartyFleet, publishers: dict[str, vp.VllmPublisher]
) -> None:
    # 24 blocks of 32 tokens per engine; each prompt ~10 blocks: a few prompts fill an engine, so it evicts.
    cluster, engines = await fleet(third_party, publishers, capacity=24)
    prompts = [f"document {i}: " + f"paragraph {i} of the shared corpus. " * 9 for i in range(8)]
    rng = random.Random(7)
    hits = 0
    for _ in range(60):
        predicted, cached, _ = await ask(cluster, rng.choice(prompts))
        assert predicted == cached
        hits += cached > 0
        await caught_up(cluster, publishers)
    assert hits >= 15
    # 8 prompts of ~10 blocks each do not fit in 2 x 24 blocks: the engines evicted, and said so.
    assert sum(e.pool.used for e in engines.values()) <= 48 < 8 * 10
    # What a follower compares with the batches it heard, to say when its endpoint is wrong.
    assert all(e.awaited_blocks > 0 for e in cluster.gateway.fleet)
    assert all(f.batches > 0 for f in followers(cluster))


async def test_a_reset_and_a_restart_leave_no_stale_residency(
    third_party: ThirdPartyFleet, publishers: dict[str, vp.VllmPublisher]
) -> None:
    cluster, engines = await fleet(third_party, publishers, capacity=256)
    prompt = "a long agent system prompt, resent every turn. " * 12
    _, _, engine_id = await ask(cluster, prompt)
    await caught_up(cluster, publishers)
    predicted, cached, again = await ask(cluster, prompt)
    assert again == engine_id and predicted == cached > 0
    # /reset_prefix_cache: vLLM announces AllBlocksCleared.
    assert engines[engine_id].reset_prefix_cache()
    await caught_up(cluster, publishers)
    predicted, cached, _ = await ask(cluster, prompt)
    assert predicted == cached == 0
    await caught_up(cluster, publishers)
    # A restart: the engine's cache is empty and its event seq starts at 0 again; nothing is announced.
    engine = engines[engine_id]
    engine.pool = BlockPool(engine.kv_capacity_blocks, engine._queue_event, vllm_hash_id)
    publishers[engine_id].restart()
    publishers[engine_id].publish([])  # its first step after the restart: seq 0
    follower = next(f for f in followers(cluster) if f.engine.id == engine_id)
    await cluster.wait_for(lambda: follower.restarts >= 1)
    predicted, cached, landed = await ask(cluster, prompt)
    assert predicted == cached == 0, (predicted, cached, landed)


async def test_every_follower_counter_is_on_the_metrics_page_per_engine(
    third_party: ThirdPartyFleet, publishers: dict[str, vp.VllmPublisher]
) -> None:
    """An operator alerts on these: each of a follower's counters, for each engine it follows."""
    cluster, _ = await fleet(third_party, publishers, capacity=256)
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/metrics") as r:
        page = await r.text()
    names = ("batches", "resyncs", "replays", "gaps", "restarts", "decode_errors", "unknown_events",
             "unknown_parent_blocks", "unindexable_blocks", "ignored_blocks", "disconnects",
             "oversized_messages", "errors")  # fmt: skip
    for engine_id in ENGINES:
        region = engine_id.split("/")[0]
        for name in names:
            labels = f'engine="{engine_id}",region="{region}"'
            if name in ("batches", "resyncs", "unknown_events"):
                labels += ',source="zmq"'  # (kvgate's own engines: "kvgate")
            assert f"kvgate_kv_event_{name}_total{{{labels}}}" in page, name
