"""The gateway tells an engine to pull a prefix its region's peer holds (kvgate's real engine, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache.sessions import SessionBinding
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.harness import Cluster, ClusterFactory


def ids(n: int, offset: int = 0) -> list[int]:
    return [(11 * j + 5 + offset) % 500 + 3 for j in range(n)]


async def complete(cluster: Cluster, prompt: list[int], session: str) -> tuple[dict[str, Any], Any]:
    body = {"model": cluster.model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, answer, headers = await cluster.post(
        "/v1/completions", body, headers={"x-session-affinity": session}
    )
    assert status == 200, answer
    return answer, headers


async def second_conversation_elsewhere(
    cluster: Cluster, prompt: list[int], engines: list[str]
) -> tuple[str, str, int, dict[str, Any], Any]:
    """A first conversation computes ``prompt`` on one of ``engines``; a second one over the same document,
    bound to another of them, continues it. Returns (holder, other, prefix tokens, answer, headers)."""
    gateway = cluster.gateway
    await cluster.wait_for(lambda: all(e.kv_pull for e in gateway.fleet))
    _, first = await complete(cluster, prompt, "first")
    holder = first["x-kvgate-engine"]
    other = next(e for e in engines if e != holder)
    hashes = gateway.prepare.block_hashes(prompt, cluster.model)
    await cluster.wait_for(lambda: gateway.state.lookup(hashes).get(holder, 0) == len(hashes))
    gateway.state.bind_session("default", "second", SessionBinding("eu-west", other))
    answer, headers = await complete(cluster, [*prompt, 17, 18, 19], "second")
    return holder, other, len(hashes) * gateway.settings.block_size, answer, headers


async def test_a_session_bound_elsewhere_pulls_the_prefix_its_peer_computed(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster({"eu-west": 2}, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir))
    prompt = ids(600)
    holder, other, prefix, answer, headers = await second_conversation_elsewhere(
        cluster, prompt, ["eu-west/e0", "eu-west/e1"]
    )
    # Moving the second conversation would save only the pull, so it stays, and its engine pulls the
    # prefix instead of computing it again.
    assert headers["x-kvgate-engine"] == other and headers["x-kvgate-kv-pull-from"] == holder
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix
    reference = LLMEngine(EngineConfig(str(tiny_model_dir), num_kv_blocks=256, device="cpu"))
    expected = reference.generate([[*prompt, 17, 18, 19]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert answer["choices"][0]["text"] == reference.tokenizer.decode(expected)
    assert _counter(cluster, "kvgate_kv_pull_tokens_total") == prefix


async def test_a_decode_engine_that_pulls_its_prefix_prefills_only_the_rest_itself(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    roles = {"eu-west/e0": "prefill", "eu-west/e1": "decode", "eu-west/e2": "decode"}
    cluster = await make_cluster({"eu-west": 3}, real_model=tiny_model_dir, roles=roles,
                                 tokenizer=str(tiny_model_dir))  # fmt: skip
    holder, other, prefix, answer, headers = await second_conversation_elsewhere(
        cluster, ids(600, offset=3), ["eu-west/e1", "eu-west/e2"]
    )
    # The other decode engine holds nothing, but it can pull 592 tokens from its peer: the 11 left are
    # fewer than local_prefill_max_tokens, so no prefill engine is involved.
    assert headers["x-kvgate-engine"] == other and headers["x-kvgate-prefill"] == "local"
    assert headers["x-kvgate-kv-pull-from"] == holder
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == prefix


def _counter(cluster: Cluster, name: str) -> float:
    registry = cluster.gateway.metrics.registry
    return sum(s.value for m in registry.collect() for s in m.samples if s.name == name)
