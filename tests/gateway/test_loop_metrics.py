"""The lock-free gateway metrics write exactly what prometheus_client's own Counter and Histogram write."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.1, 1, 10)
LABELS = st.sampled_from(["a", "b", "c"])
OPS = st.lists(
    st.tuples(LABELS, LABELS, st.floats(0, 20, allow_nan=False) | st.sampled_from([0.005, 0.01, 1.0, 10.0])),
    max_size=40,
)


def exposition(registry: CollectorRegistry) -> list[str]:
    """The text format without the ``_created`` timestamps, which differ by construction time."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if not re.match(r"^\w+_created\b", line)]


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_same_exposition_as_prometheus_client(ops: list[tuple[str, str, float]]) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    counter = LoopCounter("t_events", "Events.", ["region", "engine"], registry=ours)
    histogram = LoopHistogram("t_seconds", "Seconds.", ["region"], buckets=BUCKETS, registry=ours)
    bare = LoopHistogram("t_bare_seconds", "Bare.", buckets=BUCKETS, registry=ours)
    ref_counter = Counter("t_events", "Events.", ["region", "engine"], registry=theirs)
    ref_histogram = Histogram("t_seconds", "Seconds.", ["region"], buckets=BUCKETS, registry=theirs)
    ref_bare = Histogram("t_bare_seconds", "Bare.", buckets=BUCKETS, registry=theirs)
    for region, engine, value in ops:
        counter.labels(region, engine).inc(value)
        ref_counter.labels(region, engine).inc(value)
        histogram.labels(region).observe(value)
        ref_histogram.labels(region).observe(value)
        bare.observe(value)
        ref_bare.observe(value)
    assert exposition(ours) == exposition(theirs)
    lines = generate_latest(ours).decode().splitlines()
    created = [line for line in lines if "_created" in line and not line.startswith("#")]
    assert len(created) == len({(r, e) for r, e, _ in ops}) + len({r for r, _, _ in ops}) + 1


def test_counters_refuse_to_go_down_and_labels_must_match() -> None:
    counter = LoopCounter("t_x", "X.", ["a"], registry=CollectorRegistry())
    with pytest.raises(ValueError, match="only go up"):
        counter.labels("1").inc(-1)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("1", "2")
