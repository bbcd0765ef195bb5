"""The gateway tells an engine to pull a prefix its region's peer holds (kvgate's real engine, tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cache.sessions import SessionBinding
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.harness import ClusterFactory


def ids(n: int, offset: int = 0) -> list[int]:
    return [(11 * j + 5 + offset) % 500 + 3 for j in range(n)]


def completion(model: str, prompt: list[int], session: str) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return body, {"x-session-affinity": session}


async def test_a_session_bound_elsewhere_pulls_the_prefix_its_peer_computed(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster({"eu-west": 2}, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir))
    gateway = cluster.gateway
    await cluster.wait_for(lambda: all(e.kv_pull for e in gateway.fleet))
    prompt = ids(600)
    body, headers = completion(cluster.model, prompt, "first")
    status, answer, first = await cluster.post("/v1/completions", body, headers=headers)
    assert status == 200, answer
    holder = first["x-kvgate-engine"]
    other = next(e.id for e in gateway.fleet if e.id != holder)
    hashes = gateway.prepare.block_hashes(prompt, cluster.model)
    await cluster.wait_for(lambda: gateway.state.lookup(hashes).get(holder, 0) == len(hashes))
    # A second conversation over the same document is bound to the other engine: moving it would save only
    # the pull, so it stays there, and that engine pulls the prefix instead of computing it again.
    gateway.state.bind_session("default", "second", SessionBinding("eu-west", other))
    longer = [*prompt, 17, 18, 19]
    body, headers = completion(cluster.model, longer, "second")
    status, answer, second = await cluster.post("/v1/completions", body, headers=headers)
    assert status == 200, answer
    assert second["x-kvgate-engine"] == other and second["x-kvgate-kv-pull-from"] == holder
    pulled = len(hashes) * gateway.settings.block_size
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == pulled
    reference = LLMEngine(EngineConfig(str(tiny_model_dir), num_kv_blocks=256, device="cpu"))
    expected = reference.generate([longer], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert answer["choices"][0]["text"] == reference.tokenizer.decode(expected)
    assert _counter(gateway, "kvgate_kv_pull_tokens_total") == pulled


def _counter(gateway: Any, name: str) -> float:
    return sum(s.value for m in gateway.metrics.registry.collect() for s in m.samples if s.name == name)


async def test_a_decode_engine_that_pulls_its_prefix_prefills_only_the_rest_itself(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    roles = {"eu-west/e0": "prefill", "eu-west/e1": "decode", "eu-west/e2": "decode"}
    cluster = await make_cluster({"eu-west": 3}, real_model=tiny_model_dir, roles=roles,
                                 tokenizer=str(tiny_model_dir))  # fmt: skip
    gateway = cluster.gateway
    await cluster.wait_for(lambda: all(e.kv_pull for e in gateway.fleet))
    prompt = ids(600, offset=3)
    body, headers = completion(cluster.model, prompt, "first")
    status, answer, first = await cluster.post("/v1/completions", body, headers=headers)
    assert status == 200 and first["x-kvgate-prefill"] == "remote", answer  # 600 new tokens: prefilled
    holder = first["x-kvgate-decode-engine"]
    other = "eu-west/e2" if holder == "eu-west/e1" else "eu-west/e1"
    hashes = gateway.prepare.block_hashes(prompt, cluster.model)
    await cluster.wait_for(lambda: gateway.state.lookup(hashes).get(holder, 0) == len(hashes))
    # The other decode engine holds nothing, but it can pull 592 tokens from its peer: the 11 left are
    # fewer than local_prefill_max_tokens, so no prefill engine is involved.
    gateway.state.bind_session("default", "second", SessionBinding("eu-west", other))
    longer = [*prompt, 17, 18, 19]
    body, headers = completion(cluster.model, longer, "second")
    status, answer, second = await cluster.post("/v1/completions", body, headers=headers)
    assert status == 200, answer
    assert second["x-kvgate-engine"] == other and second["x-kvgate-prefill"] == "local"
    assert second["x-kvgate-kv-pull-from"] == holder
    assert (
        answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(hashes) * gateway.settings.block_size
    )
