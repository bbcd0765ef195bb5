"""One ``/metrics`` for all the workers of ``kvgate serve --workers N`` on the public port.

The workers share the public port (SO_REUSEPORT), so a scrape reaches whichever worker the kernel picks. Had
each answered with its own counts, successive scrapes would read as counter resets, and ``rate()`` would
spike and lose counts. So each worker writes a snapshot of its families to a directory the workers share
(every ``interval_s``, and at once when it is scraped), and any worker answers with every snapshot merged,
as prometheus_client's multiprocess mode does for gunicorn's workers:

- counters, histograms and summaries are summed per series (``_created`` keeps the earliest);
- gauges and the rest are each worker's own view, so each keeps its series with a ``worker`` label.

Every snapshot read is one its worker wrote, and a snapshot is only ever replaced by a newer one, so the sums
never go back between scrapes. Workers start and stop together (``gateway.http.workers``), and ``kvgate
serve`` empties the directory before they start, so no count of an earlier run is added in.

With ``gateway.operator_port`` set, each worker has an operator port of its own and is scraped there as
itself; this module is then not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from cache.cancelling import cancel_and_wait

log = logging.getLogger("kvgate.metrics")

SUMMED = ("counter", "histogram", "summary", "gaugehistogram")
WORKER_LABEL = "worker"
SNAPSHOT_SUFFIX = ".metrics.json"


def clear_snapshots(directory: Path) -> None:
    """Make ``directory`` and remove an earlier run's snapshots from it (``kvgate serve``, before its workers
    start)."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"*{SNAPSHOT_SUFFIX}*"):
        stale.unlink(missing_ok=True)


def snapshot(collector: Collector) -> bytes:
    """``collector``'s families as JSON: name, type, help, unit and samples (name, labels, value)."""
    families = [
        {
            "name": family.name,
            "type": family.type,
            "help": family.documentation,
            "unit": family.unit,
            "samples": [(s.name, s.labels, s.value) for s in family.samples],
        }
        for family in collector.collect()
    ]
    return orjson.dumps(families)


def merge(snapshots: dict[str, list[dict[str, Any]]]) -> list[Metric]:
    """The families of every worker's snapshot (by worker name) as one set of families."""
    merged: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for worker, families in sorted(snapshots.items()):
        for family in families:
            name, kind = family["name"], family["type"]
            metric = merged.get(name)
            if metric is None:
                metric = merged[name] = Metric(name, family["help"], kind, family["unit"])
                sums[name] = {}
            elif metric.type != kind:  # (workers of different builds): the first one's type stands
                continue
            for sample_name, labels, value in family["samples"]:
                if kind in SUMMED:
                    key = (sample_name, tuple(sorted(labels.items())))
                    seen = sums[name].get(key)
                    if seen is None:
                        sums[name][key] = value
                    elif sample_name.endswith("_created"):
                        sums[name][key] = min(seen, value)
                    else:
                        sums[name][key] = seen + value
                else:
                    metric.add_sample(sample_name, {**labels, WORKER_LABEL: worker}, value)
    for name, series in sums.items():
        for (sample_name, labels), value in series.items():
            merged[name].add_sample(sample_name, dict(labels), value)
    return list(merged.values())


class WorkerMetrics:
    """This worker's snapshots, written to ``directory`` as ``<worker>.metrics.json``, and the merge of all
    of them: a collector that ``prometheus_client``'s encoders take as they take a registry."""

    def __init__(self, directory: Path, worker: str, own: Collector, *, interval_s: float = 1.0) -> None:
        self.directory = directory
        self.worker = worker
        self.own = own
        self.interval_s = interval_s
        self._path = directory / f"{worker}{SNAPSHOT_SUFFIX}"
        self._task: asyncio.Task[None] | None = None

    def write(self) -> None:
        """This worker's snapshot, replaced whole (written beside it, then renamed over it)."""
        partial = self._path.with_name(f"{self._path.name}.{os.getpid()}.tmp")
        data = snapshot(self.own)
        try:
            partial.write_bytes(data)
        except FileNotFoundError:  # (the directory was removed under a running gateway: made again)
            self.directory.mkdir(parents=True, exist_ok=True)
            partial.write_bytes(data)
        os.replace(partial, self._path)

    def read_all(self) -> dict[str, list[dict[str, Any]]]:
        """Every worker's latest snapshot: one being replaced is read whole, as it was or as it is now."""
        snapshots: dict[str, list[dict[str, Any]]] = {}
        for path in self.directory.glob(f"*{SNAPSHOT_SUFFIX}"):
            with contextlib.suppress(OSError, orjson.JSONDecodeError):
                snapshots[path.name.removesuffix(SNAPSHOT_SUFFIX)] = orjson.loads(path.read_bytes())
        return snapshots

    def collect(self) -> Iterator[Metric]:
        """Write this worker's snapshot first, then merge: a scrape sees this worker's counts of now."""
        self._try_write()
        yield from merge(self.read_all())

    def start(self) -> None:
        self._try_write()
        self._task = asyncio.create_task(self._write_forever(), name="kvgate-worker-metrics")

    async def stop(self) -> None:
        """Stop writing, with a last snapshot: what this worker counted stays in the others' answers."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        self._try_write()

    async def _write_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._try_write()

    def _try_write(self) -> None:
        try:
            self.write()
        except OSError as exc:  # a full or vanished directory: scrapes read the snapshots that are there
            log.warning("cannot write this worker's metrics to %s: %s", self.directory, exc)
