"""``kvgate simulate``: the gateway's real policies replayed on the trace model."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import gateway.simulate as simulate_module
from gateway.routing import POLICIES
from gateway.routing.base import RoutingSettings
from gateway.routing.router import Router
from gateway.simulate import run_simulation, sim_router
from perfmodel.profiles import profile, with_overrides
from region_map.simulation.batched import BatchedSimEngine
from region_map.simulation.simulator import CostModel, SimEngine
from region_map.simulation.trace import TraceRequest, load_trace

TRACE = Path(__file__).resolve().parents[1] / "data" / "mooncake_conversation_trace.jsonl.gz"
KEYS = {"hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "load_max_over_mean",
        "cross_region_share"}  # fmt: skip


def synthetic(tmp_path: Path) -> Path:
    """42 conversations of 3 turns each, all sharing block 0, turns 3 s apart."""
    rows = []
    for turn in range(3):
        for c in range(42):
            blocks = [0, *(1000 * c + j for j in range(1, 3 + 2 * turn))]
            rows.append({"timestamp": turn * 3000 + c * 10, "input_length": 512 * len(blocks) - 100,
                         "output_length": 20, "hash_ids": blocks})  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sorted(rows, key=lambda r: r["timestamp"])))
    return path


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_replays_the_trace(tmp_path: Path, policy: str) -> None:
    trace = load_trace(synthetic(tmp_path))
    result = run_simulation(trace, policy=policy, regions=2, engines_per_region=2, capacity_blocks=200)
    assert result.requests == 126
    assert 0 <= result.hit_rate <= result.oracle_hit_rate <= 1
    assert result.ttft_p50_s <= result.ttft_p90_s <= result.ttft_p99_s


def test_session_aware_policies_keep_conversations_together(tmp_path: Path) -> None:
    trace = load_trace(synthetic(tmp_path))
    default = run_simulation(trace, policy="default", regions=1, engines_per_region=4, capacity_blocks=200)
    spread = run_simulation(trace, policy="round_robin", regions=1, engines_per_region=4, capacity_blocks=200)
    assert default.hit_rate >= 0.98 * default.oracle_hit_rate  # turns find their history (a few move away)
    assert spread.hit_rate < default.hit_rate
    assert default.load_max_over_mean <= 1.2


def test_only_the_default_policy_asks_engines_to_pull() -> None:
    trace = load_trace(TRACE, limit=3000)
    runs = {
        (policy, rate): run_simulation(trace, policy=policy, regions=1, engines_per_region=4,
                                       capacity_blocks=2000, cost=CostModel(kv_pull_tokens_per_s=rate))
        for policy, rate in (("default", 85_000.0), ("default", 0.0), ("cache_aware", 85_000.0))
    }  # fmt: skip
    assert runs["default", 85_000.0].pull_share > 0
    assert runs["default", 0.0].pull_share == runs["cache_aware", 85_000.0].pull_share == 0
    # Pulled blocks are blocks nobody computed: they count as hits, and the pulls find more of them. (Where
    # the cache is so small that it evicts within a conversation's turns, about 1000 blocks here, a pulled
    # copy costs as much capacity as it saves: the two rates then tie within 0.2 points.)
    assert runs["default", 85_000.0].hit_rate > runs["default", 0.0].hit_rate


def test_the_simulator_routes_with_the_gateways_router_fed_by_kv_events() -> None:
    """No second copy of the decision: the simulation drives gateway.routing.router.Router, whose residency
    view follows the simulated engines' stored and evicted blocks."""
    sim = sim_router(POLICIES["cache_aware"](RoutingSettings()), RoutingSettings(), regions=["r"],
                     engines_per_region=2, rtt_s=0.04, uses_sessions=False)  # fmt: skip
    assert isinstance(sim.router, Router)
    sim.kv_changed("r/e0", [1, 2, 3], [])
    sim.kv_changed("r/e0", [], [3])
    assert sim.router.state.lookup([1, 2, 3]) == {"r/e0": 2}
    engines = [SimEngine(f"r/e{i}", "r", 100, CostModel(), sim.kv_changed) for i in range(2)]
    request = TraceRequest(arrival_s=0.0, input_tokens=3 * 512 + 1, output_tokens=1, blocks=(1, 2, 9, 10),
                           conversation=7)  # fmt: skip
    engine, source = sim.route(request, "r", 0.0, engines)
    assert engine.id == "r/e0" and source is None  # where its first two blocks are


def test_a_routed_prompt_stays_in_its_engines_prefill_queue_until_its_first_token() -> None:
    """As a live gateway's: until then the router counts its tokens as queued there and does not price its
    uncomputed blocks as pullable (before, the simulated router dropped both at once, so under overload it
    sent sessions to pull prefixes that were still queued and found nothing there)."""
    settings = RoutingSettings(prefill_s_per_token=1e-4)
    sim = sim_router(POLICIES["default"](settings), settings, regions=["r"], engines_per_region=2,
                     rtt_s=0.04, uses_sessions=True)  # fmt: skip
    engines = [SimEngine(f"r/e{i}", "r", 100, CostModel(), sim.kv_changed) for i in range(2)]
    first = TraceRequest(arrival_s=0.0, input_tokens=4 * 512, output_tokens=1, blocks=(1, 2, 3, 4),
                         conversation=7)  # fmt: skip
    engine, _ = sim.route(first, "r", 0.0, engines)
    engine.serve(0.0, first)
    queue = sim.fleet.engines[engine.id].prefill
    assert queue.tokens == 4 * 512
    assert queue.computed_blocks([1, 2, 3, 4], 4) == 0
    sim.first_token(1, 0.2)
    assert queue.tokens == 0 and queue.computed_blocks([1, 2, 3, 4], 4) == 4


def test_the_simulated_router_reads_a_batching_engines_free_slots_and_kv_as_a_live_one_does() -> None:
    """A batching engine's load carries its slot limit and free KV (as kvgate's /health does), so the load
    guard can tell a queue waiting for prefill budget from one waiting for room; the FIFO model says neither,
    and its queues are always counted."""
    settings = RoutingSettings(prefill_s_per_token=1e-4)
    sim = sim_router(POLICIES["default"](settings), settings, regions=["r"], engines_per_region=2,
                     rtt_s=0.04, uses_sessions=True)  # fmt: skip
    small = with_overrides(profile("llama3-8b-h100"), max_running=4, kv_capacity_tokens=64 * 512)
    batched = [BatchedSimEngine(f"r/e{i}", "r", 100, CostModel(), sim.kv_changed, small) for i in range(2)]
    first = TraceRequest(arrival_s=0.0, input_tokens=4 * 512, output_tokens=1000, blocks=(1, 2, 3, 4),
                         conversation=7)  # fmt: skip
    engine, _ = sim.route(first, "r", 0.0, batched)
    engine.submit("k", 0.0, first)
    engine.advance(0.5)  # its prefill has run; it decodes
    second = TraceRequest(arrival_s=0.5, input_tokens=512, output_tokens=8, blocks=(9,), conversation=8)
    sim.route(second, "r", 0.5, batched)
    state = sim.fleet.engines[engine.id]
    # The first request holds 4 x 512 + 1000 tokens of KV, rounded up to whole blocks of the profile's size.
    held = -(-(4 * 512 + 1000) // small.block_size) * small.block_size
    assert state.load.running == 1
    assert (state.load.max_running, state.load.kv_blocks_free) == (4, (64 * 512 - held) // 512)
    assert not state.waits_for_room(0)
    fifo = [SimEngine(f"r/e{i}", "r", 100, CostModel(), sim.kv_changed) for i in range(2)]
    sim.route(second, "r", 0.6, fifo)
    assert state.load.max_running is None and state.waits_for_room(0)


def test_the_cli_prints_the_documented_json(tmp_path: Path) -> None:
    args = ["simulate", "--trace", str(synthetic(tmp_path)), "--regions", "2", "--engines-per-region", "2"]
    args += ["--capacity-blocks", "100", "--policy", "default", "--json"]
    command = [sys.executable, "-m", "gateway.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(result.stdout)
    assert set(figures) >= KEYS and 0 < figures["hit_rate"] <= figures["oracle_hit_rate"]


def test_the_real_trace_replays_in_under_a_minute() -> None:
    trace = load_trace(TRACE)
    assert len(trace) == 12031
    result = run_simulation(
        trace[:3000], policy="default", regions=4, engines_per_region=2, capacity_blocks=2000
    )
    assert result.hit_rate > 0.9 * result.pooled_hit_rate and result.cross_region_share < 0.2


def test_the_shipped_traces_are_the_published_ones() -> None:
    digest = hashlib.sha256(gzip.decompress(TRACE.read_bytes())).hexdigest()
    assert digest == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    synthetic = TRACE.with_name("mooncake_synthetic_trace.jsonl.gz")
    digest = hashlib.sha256(gzip.decompress(synthetic.read_bytes())).hexdigest()
    assert digest == "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"
    assert len(load_trace(synthetic)) == 3993


# The default (FIFO prefill) model's figures on the synthetic trace, recorded before the batching mode was
# added: the opt-in mode must leave them exactly as they were. The default policy's row changed twice since,
# on purpose: a pull gets only blocks whose prefill has run at the source (its one pull here found the
# prefix still queued there, so it now pulls less and computes more: hit rate 0.1968 -> 0.1937, p99 +10 ms);
# and the router keeps each prompt in its engine's prefill queue until its first token, as live, so it no
# longer asks for that pull at all (pull share 0.0159 -> 0; every other figure unchanged). Every row changed
# once more when the engines' LRU came to evict a chain's tail before its head, as vLLM's does: with 20
# blocks an engine evicts all the time, and no longer keeps tails that no prompt can reach (hit rate
# 0.1937 -> 0.1968 default, 0.1952 the others; the default policy moves more sessions across regions,
# 0.103 -> 0.119, and cache_aware's p50 and round_robin's p50 moved by -12 and +10 ms).
FIFO_FIGURES = {
    "default": (0.19682539682539682, 0.27959999999999985, 0.9288000000000007, 1.2346000000000004,
                1.0476190476190477, 0.11904761904761904, 0.0),
    "cache_aware": (0.19523809523809524, 0.2671999999999999, 0.9288000000000007, 1.2346000000000004,
                    1.0476190476190477, 0.1349206349206349, 0.0),
    "round_robin": (0.19523809523809524, 0.28959999999999964, 0.8688000000000002, 1.2346000000000004,
                    1.0476190476190477, 0.20634920634920634, 0.0),
}  # fmt: skip


@pytest.mark.parametrize("policy", sorted(FIFO_FIGURES))
def test_the_default_model_is_unchanged(tmp_path: Path, policy: str) -> None:
    trace = load_trace(synthetic(tmp_path))
    r = run_simulation(trace, policy=policy, regions=2, engines_per_region=2, capacity_blocks=20)
    figures = (r.hit_rate, r.ttft_p50_s, r.ttft_p90_s, r.ttft_p99_s, r.load_max_over_mean,
               r.cross_region_share, r.pull_share)  # fmt: skip
    assert figures == pytest.approx(FIFO_FIGURES[policy], rel=1e-12, abs=1e-15)


def test_a_profile_past_its_throughput_queues(tmp_path: Path) -> None:
    """With the batching model, arrivals beyond an engine's prefill throughput wait: TTFT p90 grows."""
    trace = load_trace(synthetic(tmp_path))
    light = profile("llama3-8b-h100")
    heavy = with_overrides(light, prefill_s_per_token=2e-3)  # ~3 s a prompt; 42 prompts come in 0.42 s
    runs = {
        name: run_simulation(trace, policy="default", regions=1, engines_per_region=4, capacity_blocks=200,
                             profile=p)
        for name, p in (("light", light), ("heavy", heavy))
    }  # fmt: skip
    assert runs["light"].ttft_p90_s < 0.5
    assert runs["heavy"].ttft_p90_s > 10 * runs["light"].ttft_p90_s
    assert runs["heavy"].hit_rate > 0  # the caches work the same in both


def test_the_routers_estimate_takes_the_profiles_prefill_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[float] = []
    real = simulate_module.sim_router

    def spy(policy: object, settings: RoutingSettings, **kwargs: object) -> object:
        seen.append(settings.prefill_s_per_token)
        return real(policy, settings, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(simulate_module, "sim_router", spy)
    trace = load_trace(synthetic(tmp_path))[:10]
    run_simulation(trace, policy="default", regions=1, engines_per_region=2, capacity_blocks=20)
    run_simulation(trace, policy="default", regions=1, engines_per_region=2, capacity_blocks=20,
                   profile=profile("llama3-70b-h100"))  # fmt: skip
    assert seen == [1 / 20_000, 7.1e-5]


def test_the_cli_takes_a_profile_and_rejects_an_unknown_one(tmp_path: Path) -> None:
    base = [sys.executable, "-m", "gateway.cli", "simulate", "--trace", str(synthetic(tmp_path)), "--json"]
    ok = subprocess.run([*base, "--profile", "llama3-70b-h100", "--profile-overrides", "max_running=64"],
                        capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    assert set(json.loads(ok.stdout)) >= KEYS
    cases = [(["--profile", "llama3-405b"], ["'llama3-405b'", "llama3-8b-h100", "llama3-70b-h100"]),
             (["--profile", "llama3-8b-h100", "--profile-overrides", "speed=9"], ["'speed'"]),
             (["--profile-overrides", "max_running=64"], ["--profile"])]  # fmt: skip
    for extra, words in cases:
        bad = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and bad.stdout == ""
        assert len(bad.stderr.strip().splitlines()) == 1 and bad.stderr.startswith("kvgate simulate: ")
        assert all(word in bad.stderr for word in words)
