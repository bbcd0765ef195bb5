"""Fixtures for gateway tests: whole clusters of simulated engines and gateways (see tests/harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.harness import Cluster, ClusterFactory, start_cluster


@pytest.fixture
async def make_cluster() -> AsyncIterator[ClusterFactory]:
    clusters: list[Cluster] = []

    async def make(*args: Any, **kwargs: Any) -> Cluster:
        cluster = await start_cluster(*args, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        await cluster.close()
