"""Label values that an engine's answers choose stay in a closed set: an engine cannot grow /metrics."""

from __future__ import annotations

from gateway.http.relay import KNOWN_502_CODES, upstream_error_kind
from gateway.observability.metrics import GatewayMetrics
from tests.harness import MODEL, Cluster, ClusterFactory


def _upstream_error_series(metrics: GatewayMetrics) -> set[tuple[str, ...]]:
    return {
        tuple(sorted(sample.labels.items()))  # type: ignore[misc]
        for family in metrics.registry.collect()
        if family.name == "kvgate_upstream_errors"
        for sample in family.samples
        if sample.name == "kvgate_upstream_errors_total"
    }


def test_engine_error_codes_give_a_bounded_number_of_series() -> None:
    metrics = GatewayMetrics()
    for i in range(500):  # what a P/D decode engine (or whatever answers on its port) puts in its 502's code
        metrics.upstream_error("eu-west/e0", upstream_error_kind(502, f"made_up_{i}\n{'x' * 100}"))
    metrics.upstream_error("eu-west/e0", upstream_error_kind(502, None))
    for code in KNOWN_502_CODES:
        metrics.upstream_error("eu-west/e0", upstream_error_kind(502, code))
    for status in (500, 503, 0, 999, 10**9):
        metrics.upstream_error("eu-west/e0", upstream_error_kind(status))
    kinds = {dict(series)["kind"] for series in _upstream_error_series(metrics)}
    assert kinds == {"http_502", "http_500", "http_503", "http_other"} | {
        f"http_502_{code}" for code in KNOWN_502_CODES
    }
    assert upstream_error_kind(502, "kv_transfer_failed") == "http_502_kv_transfer_failed"


async def _series(cluster: Cluster) -> set[str]:
    """The sample lines of the gateway's /metrics, less their values: one per series."""
    assert cluster.session is not None
    async with cluster.session.get(cluster.url + "/metrics") as r:
        text = await r.text()
    return {line.rpartition(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


async def test_values_a_client_chooses_never_become_label_values(make_cluster: ClusterFactory) -> None:
    """Model names, paths, methods, request ids, sessions, users, user agents and stored-response ids that a
    client makes up, a distinct one per request: past the first few rounds (each status an endpoint answers
    with is one series), /metrics has not one series more. Before any such value is made a label, it must be
    collapsed into a closed set."""
    cluster = await make_cluster({"eu-west": 1})
    assert cluster.session is not None
    s = cluster.session
    good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    async def round_of(i: int) -> None:
        await cluster.post("/v1/chat/completions", {**good, "model": f"made-up-{i}"})
        await cluster.post("/v1/embeddings", {"model": f"made-up-{i}", "input": "x"})
        headers = {"x-request-id": f"rid-{i}", "x-session-affinity": f"s-{i}", "user-agent": f"ua-{i}"}
        await cluster.post("/v1/chat/completions", {**good, "user": f"u-{i}"}, headers=headers)
        for method, path in (("GET", f"/made/up/{i}"), (f"M{i}", "/v1/chat/completions"),
                             ("GET", f"/v1/models/m-{i}"), ("GET", f"/v1/responses/resp_{i}"),
                             ("POST", f"/v1/responses/resp_{i}/cancel")):  # fmt: skip
            async with s.request(method, cluster.url + path) as r:
                await r.read()

    for i in range(5):
        await round_of(i)
    await _series(cluster)  # (the scrape counts itself: its own series, from the next scrape on)
    warm = await _series(cluster)
    for i in range(5, 300):
        await round_of(i)
    assert await _series(cluster) == warm
