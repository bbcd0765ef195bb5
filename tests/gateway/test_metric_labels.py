"""Label values that an engine's answers choose stay in a closed set: an engine cannot grow /metrics."""

from __future__ import annotations

from gateway.http.relay import KNOWN_502_CODES, upstream_error_kind
from gateway.observability.metrics import GatewayMetrics


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
