"""``/metrics`` as Prometheus and its tools read it: every family parses, counters are typed counters and
named ``_total``, histograms hold together, after real traffic through a real gateway."""

from __future__ import annotations

import socket

from prometheus_client.parser import text_string_to_metric_families

from tests.harness import MODEL, Cluster, ClusterFactory


async def scrape(cluster: Cluster, headers: dict[str, str] | None = None) -> tuple[str, str]:
    """(Content-Type, body) of the gateway's ``/metrics``."""
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/metrics", headers=headers) as r:
        assert r.status == 200
        return r.headers["Content-Type"], await r.text()


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
    _, text = await scrape(cluster)
    found = families(text)
    for name in ("kvgate_redis_write_failures", "kvgate_ledger_spooled_records"):
        kind, samples = found[name]
        assert kind == "counter", (name, kind)  # (a gauge would tell rate() and alerts it may go down)
        assert samples[f"{name}_total[]"] > 0, samples
    assert "kvgate_ledger_degraded" in text  # (a state: stays a gauge)
    assert found["kvgate_ledger_degraded"][0] == "gauge"
