"""Engine metrics on /metrics, for the real engine and the simulator: the same names, values that move."""

from __future__ import annotations

from pathlib import Path

from engine.metrics import BusyClock
from tests.engine.kv_nodes import engine_metrics
from tests.harness import ClusterFactory


def test_busy_clock_counts_overlapping_work_once() -> None:
    now = [0.0]
    clock = BusyClock(clock=lambda: now[0])
    clock.enter()
    now[0] = 1.0
    clock.enter()  # a second request while the first is still in progress
    now[0] = 2.0
    clock.exit()
    assert clock.seconds == 2.0  # in progress: counted up to now
    now[0] = 3.0
    clock.exit()
    now[0] = 10.0
    clock.add(0.5)
    assert clock.seconds == 3.5


async def _exercise(
    cluster_factory: ClusterFactory, **kwargs: object
) -> tuple[dict[str, float], dict[str, float]]:
    cluster = await cluster_factory({"eu-west": 1}, **kwargs)
    assert cluster.session is not None
    url = next(iter(cluster.engines.values()))[1]
    before = await engine_metrics(cluster.session, url)
    messages = [{"role": "user", "content": "a question long enough to fill a few blocks " * 4}]
    for _ in range(2):
        status, body, _ = await cluster.post(
            "/v1/chat/completions",
            {"model": cluster.model, "messages": messages, "max_tokens": 4, "temperature": 0},
        )
        assert status == 200, body
    return before, await engine_metrics(cluster.session, url)


async def test_the_simulator_exports_engine_metrics(make_cluster: ClusterFactory) -> None:
    before, after = await _exercise(
        make_cluster, sim={"prefill_s_per_token": 1e-4, "decode_s_per_token": 0.002}
    )
    assert (
        after["kvgate_engine_requests_finished_total"] - before["kvgate_engine_requests_finished_total"] == 2
    )
    assert after["kvgate_engine_prefix_cache_hit_tokens_total"] > 0  # the second request hit the cache
    assert after['kvgate_engine_busy_seconds_total{stage="prefill"}'] > 0
    assert after['kvgate_engine_busy_seconds_total{stage="decode"}'] >= 2 * 4 * 0.002 * 0.9
    assert after['kvgate_engine_kv_blocks{state="used"}'] > 0
    assert 'kvgate_engine_requests{state="waiting"}' in after


async def test_the_real_engine_exports_the_same_metrics(
    make_cluster: ClusterFactory, tiny_model_dir: Path
) -> None:
    before, after = await _exercise(make_cluster, real_model=tiny_model_dir, tokenizer=str(tiny_model_dir))
    assert (
        after["kvgate_engine_requests_finished_total"] - before["kvgate_engine_requests_finished_total"] == 2
    )
    assert after["kvgate_engine_generation_tokens_total"] >= 8
    assert after["kvgate_engine_prefix_cache_hit_tokens_total"] > 0
    for stage in ("prefill", "decode"):
        assert after[f'kvgate_engine_busy_seconds_total{{stage="{stage}"}}'] > 0
    assert after['kvgate_engine_kv_blocks{state="free"}'] > 0
