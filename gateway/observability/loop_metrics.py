"""Counters and histograms that the event loop updates without a lock, exposed through prometheus_client.

prometheus_client's own metrics take a mutex on every update (0.5 us per counter increment, 0.8 us per
histogram observation, measured here) so that threads may share them. The gateway updates its request
metrics from the event loop's thread only, about ten times per request, so these keep plain numbers and
hand prometheus_client the finished families when it scrapes. Names, labels, ``_total``, ``_created`` and
the bucket ``le`` values come out exactly as prometheus_client's Counter and Histogram write them.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("counters only go up")
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # ends with +Inf
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value


Child = TypeVar("Child", CounterChild, HistogramChild)


class _Family(Collector, Generic[Child]):
    """One metric name: its children by label values, registered with ``registry`` as a collector."""

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Child] = {}
        registry.register(self)

    def labels(self, *values: str) -> Child:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {values}")
            child = self._children[values] = self._new_child()
        return child

    def _new_child(self) -> Child:
        raise NotImplementedError

    def describe(self) -> Iterable[Metric]:
        return [self._family()]

    def collect(self) -> Iterable[Metric]:
        raise NotImplementedError

    def _family(self) -> Metric:
        raise NotImplementedError


class LoopCounter(_Family[CounterChild]):
    def _new_child(self) -> CounterChild:
        return CounterChild()

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in self._children.items():
            family.add_metric(values, child.value, created=child.created)
        return [family]


class LoopHistogram(_Family[HistogramChild]):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        bounds = sorted(float(b) for b in buckets)
        self.bounds = tuple(bounds if bounds and bounds[-1] == float("inf") else [*bounds, float("inf")])
        self._le = [floatToGoString(b) for b in self.bounds]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)
        if not self.labelnames:  # as with prometheus_client, an unlabelled histogram shows from the start
            self._default = self.labels()

    def observe(self, value: float) -> None:
        """For a histogram without labels."""
        self._default.observe(value)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = self._family()
        for values, child in self._children.items():
            cumulative, buckets = 0, []
            for le, count in zip(self._le, child.counts, strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(values, buckets, child.sum)
            labels = dict(zip(self.labelnames, values, strict=True))
            family.samples.append(Sample(f"{self.name}_created", labels, child.created))
        return [family]
