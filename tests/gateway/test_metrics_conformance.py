"""``/metrics`` as Prometheus and its tools read it: every family parses, counters are typed counters and
named ``_total``, histograms hold together, after real traffic through a real gateway."""

from __future__ import annotations

import itertools
import logging
import socket

import pytest
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from cache.scrape_format import choose_format
from tests.harness import MODEL, Cluster, ClusterFactory


async def scrape(cluster: Cluster) -> str:
    """The gateway's ``/metrics``."""
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


def families(text: str) -> dict[str, tuple[str, dict[str, float]]]:
    """Family name -> (type, {sample name and labels: value}), as prometheus_client's parser reads them."""
    found: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in found, f"{family.name} twice"
        found[family.name] = (
            family.type,
            {f"{s.name}{sorted(s.labels.items())}": s.value for s in family.samples},
        )
    return found


def check_histograms(text: str) -> int:
    """Every histogram series: buckets cumulative in ``le``, ``+Inf`` equal to ``_count``, a ``_sum``.
    Returns how many series were checked."""
    checked = 0
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        series: dict[tuple[tuple[str, str], ...], dict[str, list[tuple[float, float]]]] = {}
        for s in family.samples:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            bound = float(s.labels.get("le", "nan"))
            series.setdefault(key, {}).setdefault(s.name.removeprefix(family.name), []).append(
                (bound, s.value)
            )
        for key, parts in series.items():
            buckets = parts["_bucket"]
            assert [b for b, _ in buckets] == sorted(b for b, _ in buckets), (family.name, key)
            assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets)), (family.name, key)
            assert buckets[-1][0] == float("inf") and buckets[-1][1] == parts["_count"][0][1], (
                family.name,
                key,
            )
            assert len(parts["_sum"]) == 1, (family.name, key)
            checked += 1
    return checked


def closed_port() -> int:
    """A local port with nothing listening on it (the kernel just handed it out and took it back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_counts_that_only_grow_are_counters_named_total(make_cluster: ClusterFactory) -> None:
    # Redis away: shared-state writes fail and usage records go to the spool, both counted.
    cluster = await make_cluster({"eu-west": 1}, redis_url=f"redis://127.0.0.1:{closed_port()}/15")
    assert cluster.session is not None
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    for n in range(3):
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": f"turn {n} " * 40}]}
        assert (await cluster.post("/v1/chat/completions", body))[0] == 200
    writer = cluster.gateway.billing.writer
    await cluster.wait_for(lambda: writer.spooled >= 3 and cluster.gateway.state.writer.failed > 0)
    text = await scrape(cluster)
    found = families(text)
    for name in ("kvgate_redis_write_failures", "kvgate_ledger_spooled_records"):
        kind, samples = found[name]
        assert kind == "counter", (name, kind)  # (a gauge would tell rate() and alerts it may go down)
        assert samples[f"{name}_total[]"] > 0, samples
    assert "kvgate_ledger_degraded" in text  # (a state: stays a gauge)
    assert found["kvgate_ledger_degraded"][0] == "gauge"


# What Prometheus 2.x sends when it scrapes (3.x lists text/plain;version=1.0.0 too, behind OpenMetrics).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"


async def test_metrics_say_the_format_the_scraper_asked_for(make_cluster: ClusterFactory) -> None:
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with cluster.session.post(cluster.url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200
        await r.read()
    openmetrics: dict[str, dict[str, Metric]] = {}
    for who, url in (("gateway", cluster.url), ("engine", cluster.engines["eu-west/e0"][1])):
        # curl, or a scraper that knows only the classic text format: that format, under its own name.
        for accept in ("", "*/*", "text/plain;version=0.0.4"):
            async with cluster.session.get(url + "/metrics", headers={"Accept": accept}) as r:
                assert r.headers["Content-Type"] == TEXT_0_0_4, (who, accept)
                text = await r.text()
            families(text)
            if who == "gateway":  # (the stream was observed: TTFT, ITL, duration and routing overhead)
                assert check_histograms(text) >= 4
        # Prometheus: OpenMetrics, which its strict parser reads whole (ending in # EOF).
        async with cluster.session.get(url + "/metrics", headers={"Accept": PROMETHEUS_ACCEPT}) as r:
            content_type, text = r.headers["Content-Type"], await r.text()
        assert content_type.startswith("application/openmetrics-text; version=1.0.0"), (who, content_type)
        assert text.endswith("# EOF\n")
        openmetrics[who] = {f.name: f for f in openmetrics_families(text)}
    ttft = openmetrics["gateway"]["kvgate_time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    assert {s.name for s in ttft.samples} >= {f"{ttft.name}_{s}" for s in ("bucket", "count", "sum")}
    assert openmetrics["gateway"]["kvgate_requests"].type == "counter"
    assert openmetrics["engine"]["kvgate_engine_busy_seconds"].type == "counter"


# Versions no exposition format has, in the Accept header of whoever may read /metrics.
CRAFTED_ACCEPTS = (
    "application/openmetrics-text; version=1.x",  # (a TypeError in prometheus_client: a 500, a traceback)
    "text/plain; version=1.0.0a",
    "application/openmetrics-text; version=2.0<b>x</b>",  # (was written back into the Content-Type)
    "application/openmetrics-text; version=99999",
)
OPENMETRICS_1 = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"


async def test_a_crafted_accept_version_gets_a_format_that_exists(
    make_cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    caplog.set_level(logging.WARNING)
    for who, url in (("gateway", cluster.url), ("engine", cluster.engines["eu-west/e0"][1])):
        for accept in CRAFTED_ACCEPTS:
            async with cluster.session.get(url + "/metrics", headers={"Accept": accept}) as r:
                assert r.status == 200, (who, accept, r.status)
                content_type, text = r.headers["Content-Type"], await r.text()
            assert content_type == TEXT_0_0_4, (who, accept, content_type)
            families(text)
        # A scraper listing a crafted range first still gets the next one it listed.
        async with cluster.session.get(
            url + "/metrics", headers={"Accept": f"{CRAFTED_ACCEPTS[0]},{PROMETHEUS_ACCEPT}"}
        ) as r:
            assert r.headers["Content-Type"] == OPENMETRICS_1, (who, r.headers["Content-Type"])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    "accept",
    [
        "",
        "*/*",
        PROMETHEUS_ACCEPT,
        # Prometheus 3.x
        "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
        "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,"
        "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
        "application/openmetrics-text; version=2.0.0",
        "text/plain;version=1.0.0;escaping=underscores",
    ],
)
def test_real_scrapers_negotiate_as_prometheus_client_does(accept: str) -> None:
    assert choose_format(accept)[1] == choose_encoder(accept)[1]
