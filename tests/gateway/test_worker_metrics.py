"""How the workers' metric snapshots merge (gateway.observability.worker_metrics), on prometheus_client's own
families: what the public /metrics of ``kvgate serve --workers N`` answers."""

from __future__ import annotations

import shutil
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.observability.worker_metrics import WorkerMetrics, clear_snapshots


def _worker(
    directory: Path, name: str, requests: int, seconds: list[float], sessions: float
) -> WorkerMetrics:
    registry = CollectorRegistry()
    counter = Counter("kvgate_requests", "Requests.", ["status"], registry=registry)
    counter.labels("200").inc(requests)
    latency = Histogram("kvgate_seconds", "Latency.", buckets=(0.1, 1.0), registry=registry)
    for value in seconds:
        latency.observe(value)
    Gauge("kvgate_sessions", "Sessions in this view.", registry=registry).set(sessions)
    return WorkerMetrics(directory, name, registry)


def _samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_counters_and_histograms_sum_over_workers_and_gauges_keep_one_series_each(tmp_path: Path) -> None:
    clear_snapshots(tmp_path)
    a = _worker(tmp_path, "w0", 3, [0.05, 0.5], sessions=7)
    b = _worker(tmp_path, "w1", 4, [2.0], sessions=9)
    b.write()
    merged = _samples(generate_latest(a))  # (a scrape of w0 writes w0's snapshot itself)
    assert merged[("kvgate_requests_total", (("status", "200"),))] == 7
    assert merged[("kvgate_seconds_bucket", (("le", "0.1"),))] == 1
    assert merged[("kvgate_seconds_bucket", (("le", "1.0"),))] == 2
    assert merged[("kvgate_seconds_bucket", (("le", "+Inf"),))] == 3
    assert merged[("kvgate_seconds_count", ())] == 3
    assert merged[("kvgate_seconds_sum", ())] == 2.55
    assert merged[("kvgate_sessions", (("worker", "w0"),))] == 7
    assert merged[("kvgate_sessions", (("worker", "w1"),))] == 9
    created = [v for (name, _), v in merged.items() if name == "kvgate_requests_created"]
    assert len(created) == 1  # one series, the earliest start, not a sum of timestamps
    assert created[0] < 2e9


def test_an_earlier_runs_snapshots_are_cleared_and_a_removed_directory_is_made_again(tmp_path: Path) -> None:
    directory = tmp_path / "metrics"
    clear_snapshots(directory)
    _worker(directory, "old", 100, [], sessions=1).write()
    clear_snapshots(directory)  # the next run's kvgate serve
    a = _worker(directory, "w0", 2, [], sessions=1)
    assert _samples(generate_latest(a))[("kvgate_requests_total", (("status", "200"),))] == 2
    shutil.rmtree(directory)
    assert _samples(generate_latest(a))[("kvgate_requests_total", (("status", "200"),))] == 2
