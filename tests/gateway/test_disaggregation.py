"""The gateway in front of prefill and decode engines (kvgate's real engine on a tiny random model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sequence import SamplingParams
from tests.harness import ClusterFactory

PD = {"eu-west/e0": "prefill", "eu-west/e1": "decode"}


def ids(n: int, offset: int = 0) -> list[int]:
    return [(7 * j + 3 + offset) % 500 + 3 for j in range(n)]


def completion(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}


async def test_long_prompts_are_prefilled_remotely_with_the_colocated_tokens(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster(
        {"eu-west": 2}, real_model=tiny_model_dir, roles=PD, tokenizer=str(tiny_model_dir)
    )
    prompt = ids(600)
    status, body, headers = await cluster.post("/v1/completions", completion(cluster.model, prompt))
    assert status == 200, body
    assert headers["x-kvgate-prefill"] == "remote"
    assert headers["x-kvgate-prefill-engine"] == "eu-west/e0" and headers["x-kvgate-engine"] == "eu-west/e1"
    reference = LLMEngine(EngineConfig(str(tiny_model_dir), num_kv_blocks=256, device="cpu"))
    expected = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert body["choices"][0]["text"] == reference.tokenizer.decode(expected)
    # The decode engine now holds the prompt: a continuation's uncached part is small, so it stays local.
    status, body, headers = await cluster.post(
        "/v1/completions", completion(cluster.model, [*prompt, 9, 8, 7])
    )
    assert (
        status == 200
        and headers["x-kvgate-prefill"] == "local"
        and headers["x-kvgate-engine"] == "eu-west/e1"
    )
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 592


async def test_short_prompts_are_prefilled_by_the_decode_engine(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster(
        {"eu-west": 2}, real_model=tiny_model_dir, roles=PD, tokenizer=str(tiny_model_dir)
    )
    status, _, headers = await cluster.post("/v1/completions", completion(cluster.model, ids(40)))
    assert status == 200 and headers["x-kvgate-prefill"] == "local"
    assert headers["x-kvgate-prefill-engine"] == headers["x-kvgate-decode-engine"] == "eu-west/e1"


async def test_a_dead_prefill_engine_is_replaced_and_the_request_billed_once(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    roles = {"eu-west/e0": "prefill", "eu-west/e1": "prefill", "eu-west/e2": "decode"}
    cluster = await make_cluster(
        {"eu-west": 3},
        real_model=tiny_model_dir,
        roles=roles,
        tokenizer=str(tiny_model_dir),
        health_interval_s=60,
    )
    prompt = ids(500, offset=5)
    # e0 dies; the gateway's view still says it holds this prompt, so it is the first prefill choice.
    await cluster.stop_engine("eu-west/e0")
    cluster.gateway.state.index.add_now(
        "eu-west/e0", cluster.gateway.prepare.block_hashes(prompt, cluster.model)
    )
    before = _prompt_tokens(cluster.gateway.metrics)
    status, body, headers = await cluster.post("/v1/completions", completion(cluster.model, prompt))
    assert status == 200, body
    assert headers["x-kvgate-prefill"] == "remote" and headers["x-kvgate-prefill-engine"] == "eu-west/e1"
    assert headers["x-kvgate-route"] == "failover"
    assert _prompt_tokens(cluster.gateway.metrics) - before == body["usage"]["prompt_tokens"] == 500


def _prompt_tokens(metrics: Any) -> float:
    return sum(
        sample.value
        for family in metrics.prompt_tokens.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    )


async def test_with_no_prefill_engine_left_the_decode_engine_prefills(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    cluster = await make_cluster(
        {"eu-west": 2},
        real_model=tiny_model_dir,
        roles=PD,
        tokenizer=str(tiny_model_dir),
        health_interval_s=60,
    )
    await cluster.stop_engine("eu-west/e0")
    status, body, headers = await cluster.post(
        "/v1/completions", completion(cluster.model, ids(600, offset=1))
    )
    assert status == 200, body
    assert headers["x-kvgate-prefill"] == "local" and headers["x-kvgate-engine"] == "eu-west/e1"
