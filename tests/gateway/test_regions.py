"""Regions: where a client is, when a request crosses regions, the cap on doing so, warm restarts."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.routing import Candidate, DefaultPolicy, RouteRequest
from gateway.routing.base import RoutingSettings
from gateway.routing.home import HomeRegions, HomeSettings
from gateway.routing.regional import RemoteShareLimiter
from tests.harness import MODEL, ClusterFactory

REGIONS = ["eu-west", "us-east"]


def test_home_region_from_header_then_ip_prefix_then_default() -> None:
    settings = HomeSettings(
        header="cf-ipcountry",
        header_regions={"DE": "eu-west", "US": "us-east"},
        ip_prefixes={"10.1.0.0/16": "us-east", "10.1.2.0/24": "eu-west", "2001:db8::/32": "us-east"},
    )
    home = HomeRegions(settings, REGIONS, "eu-west")
    assert home.resolve({"cf-ipcountry": "US"}, "10.1.2.3") == "us-east"
    assert home.resolve({"cf-ipcountry": "us-east"}, None) == "us-east"  # a region's own name
    assert home.resolve({"cf-ipcountry": "XX"}, "10.1.9.9") == "us-east"  # unknown value: fall through
    assert home.resolve({}, "10.1.2.3") == "eu-west"  # the longest prefix wins
    assert home.resolve({}, "2001:db8::1") == "us-east"
    assert home.resolve({}, "192.0.2.1") == "eu-west"  # the gateway's own region
    assert home.resolve({}, "not-an-ip") == "eu-west"


def test_forwarded_for_is_used_only_when_trusted() -> None:
    prefixes = {"10.1.0.0/16": "us-east"}
    headers = {"x-forwarded-for": "10.1.0.7, 192.0.2.1"}
    assert (
        HomeRegions(HomeSettings(ip_prefixes=prefixes), REGIONS, "eu-west").resolve(headers, "192.0.2.1")
        == "eu-west"
    )
    trusted = HomeSettings(ip_prefixes=prefixes, trust_forwarded_for=True)
    assert HomeRegions(trusted, REGIONS, "eu-west").resolve(headers, "192.0.2.1") == "us-east"


def test_a_mapping_to_an_unknown_region_is_refused() -> None:
    with pytest.raises(ValueError, match="mars"):
        HomeRegions(HomeSettings(header_regions={"X": "mars"}), REGIONS, "eu-west")


def test_the_limiter_caps_the_remote_share_over_a_window() -> None:
    limiter = RemoteShareLimiter(max_share=0.25, window=8)
    local = Candidate("eu-west/e0", "eu-west", True, 0, 0, 0, 0.0)
    remote = Candidate("us-east/e0", "us-east", True, 0, 0, 30 * 16, 0.04)
    for _ in range(6):
        limiter.record("eu-west", "eu-west")
    limiter.record("eu-west", "us-east")
    assert limiter.allows_remote("eu-west") and list(limiter.eligible("eu-west", [local, remote])) == [
        local,
        remote,
    ]
    limiter.record("eu-west", "us-east")  # 2 of the last 8: at the cap
    assert not limiter.allows_remote("eu-west")
    assert list(limiter.eligible("eu-west", [local, remote])) == [local]
    assert list(limiter.eligible("eu-west", [remote])) == [remote]  # nothing at home: better remote than none
    for _ in range(8):
        limiter.record("eu-west", "eu-west")
    assert limiter.allows_remote("eu-west")  # the window moved on


def test_at_the_cap_a_session_bound_remotely_keeps_its_engine_and_new_placements_stay_home() -> None:
    """The cap limits new remote placements, request by request: it never revokes the region's existing
    remote affinity wholesale."""
    limiter = RemoteShareLimiter(max_share=0.25, window=4)
    local = Candidate("eu-west/e0", "eu-west", True, 0, 0, 0, 0.0)
    bound = Candidate("us-east/e0", "us-east", True, 0, 0, 30 * 16, 0.04)
    other = Candidate("us-east/e1", "us-east", True, 0, 0, 30 * 16, 0.04)
    for served in ("eu-west", "eu-west", "us-east", "us-east"):
        limiter.record("eu-west", served)
    assert not limiter.allows_remote("eu-west")
    assert list(limiter.eligible("eu-west", [local, bound, other], "us-east/e0")) == [local, bound]
    assert list(limiter.eligible("eu-west", [local, bound, other], None)) == [local]
    assert list(limiter.eligible("eu-west", [local, bound, other], "eu-west/e0")) == [local]


S = RoutingSettings(prefill_s_per_token=1e-4)


def req(tokens: int, session: str | None = "us-east/e0") -> RouteRequest:
    return RouteRequest(tokens, 1, 0, session_engine=session, home_region="eu-west")


def test_a_remote_session_stays_only_while_it_beats_recomputing_at_home() -> None:
    policy = DefaultPolicy(S)
    home = Candidate("eu-west/e0", "eu-west", True, 0, 0, 0, 0.0)
    remote = Candidate("us-east/e0", "us-east", True, 0, 0, 3200, 0.040)  # holds 3,200 tokens
    # 3,200 cached tokens save 0.32 s of prefill: worth a 40 ms round trip.
    assert policy.pick(req(3300), [home, remote]).engine == "us-east/e0"  # type: ignore[union-attr]
    # A short remote prefix saves less than a long round trip costs: the session comes home.
    short = Candidate("us-east/e0", "us-east", True, 0, 0, 32, 0.150)
    decision = policy.pick(req(3300), [home, short])
    assert decision is not None and decision.engine == "eu-west/e0" and decision.reason == "moved"


async def test_requests_cross_regions_for_a_long_cached_prefix_and_come_home_for_short_ones(
    make_cluster: ClusterFactory,
) -> None:
    cluster = await make_cluster(
        {"eu-west": 1, "us-east": 1},
        gateway_region="eu-west",
        sim={"prefill_s_per_token": 1e-4},
        home={"header": "x-client-region"},
        routing={"prefill_s_per_token": 1e-4},
    )
    system = "policy text " * 400  # ~4,800 tokens
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}],
        "max_tokens": 2,
    }
    status, _, headers = await cluster.post(
        "/v1/chat/completions", body, headers={"x-client-region": "us-east"}
    )
    assert (
        status == 200
        and headers["x-kvgate-engine"] == "us-east/e0"
        and headers["x-kvgate-home-region"] == "us-east"
    )
    # A client in eu-west with the same long prompt: the cached prefix in us-east beats recomputing at home.
    more = {**body, "messages": [*body["messages"], {"role": "user", "content": "hi"}]}
    status, _, headers = await cluster.post(
        "/v1/chat/completions", more, headers={"x-client-region": "eu-west"}
    )
    assert (
        status == 200
        and headers["x-kvgate-engine"] == "us-east/e0"
        and headers["x-kvgate-home-region"] == "eu-west"
    )
    # A short prompt from eu-west stays at home.
    short = {**body, "messages": [{"role": "user", "content": "hello"}]}
    status, _, headers = await cluster.post(
        "/v1/chat/completions", short, headers={"x-client-region": "eu-west"}
    )
    assert status == 200 and headers["x-kvgate-engine"] == "eu-west/e0"


async def test_a_zero_remote_share_keeps_everything_at_home(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster(
        {"eu-west": 1, "us-east": 1},
        gateway_region="eu-west",
        sim={"prefill_s_per_token": 1e-4},
        home={"header": "x-client-region"},
        routing={"prefill_s_per_token": 1e-4, "max_remote_share": 0.0},
    )
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "x " * 3000}],
        "max_tokens": 2,
    }
    await cluster.post("/v1/chat/completions", body, headers={"x-client-region": "us-east"})
    for _ in range(3):
        _, _, headers = await cluster.post(
            "/v1/chat/completions", body, headers={"x-client-region": "eu-west"}
        )
        assert headers["x-kvgate-engine"] == "eu-west/e0"


async def test_a_restarted_gateway_starts_warm_from_redis(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: Any
) -> None:
    opts = {f"eu-west/e{i}": {"kv_events": False} for i in range(2)}  # nothing to resync from
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix, "engine_options": opts}
    cluster = await make_cluster({"eu-west": 2}, **dict(shared))
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "warm " * 200}],
        "max_tokens": 2,
    }
    _, _, headers = await cluster.post("/v1/chat/completions", body)
    home = headers["x-kvgate-engine"]
    await cluster.gateway.state.writer.flush()
    restarted, url = await cluster.add_gateway("eu-west", **dict(shared))
    held = await restarted.state.index.holdings(home)
    assert held.approximate, "the new gateway's view starts with what the first one recorded"
    status, _, headers = await cluster.post("/v1/chat/completions", body, url=url)
    assert status == 200 and headers["x-kvgate-engine"] == home and headers["x-kvgate-route"] == "prefix"
