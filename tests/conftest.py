"""Shared fixtures: a real Redis server (never a mock), each test under a key prefix of its own."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

import tests.triton_interpret  # noqa: F401  (first: Triton's import mode, before the engine imports it)
from cache.redis_keys import RedisKeys
from tests.harness import Cluster, ClusterFactory, start_cluster
from tests.redis_process import RedisProcess

REDIS_URL = os.environ.get("KVGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests run on uvloop, as the gateway and engines do in production."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
async def redis_client() -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(REDIS_URL)
    try:
        await client.ping()
    except (RedisConnectionError, OSError) as exc:
        await client.aclose()
        pytest.fail(f"the tests need a Redis server at {REDIS_URL} (scripts/test starts one): {exc}")
    yield client
    await client.aclose()


@pytest.fixture
async def redis_keys(redis_client: aioredis.Redis) -> AsyncIterator[RedisKeys]:
    """A fresh key prefix; every key under it is deleted after the test."""
    keys = RedisKeys(f"kvgate-test-{uuid.uuid4().hex[:12]}")
    yield keys
    async for key in redis_client.scan_iter(match=f"*{keys.prefix}*", count=1000):
        await redis_client.delete(key)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Llama in the Hugging Face layout, written once per test session."""
    from engine.make_model import make_model

    return make_model(
        tmp_path_factory.mktemp("models") / "tiny-llama", "tiny", arch="llama", seed=0, dtype="float32"
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(
        tmp_path_factory.mktemp("models") / "tiny-qwen3", "tiny", arch="qwen3", seed=1, dtype="float32"
    )


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisProcess]:
    """A redis-server process of this test's own, which it may stop and restart."""
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def make_cluster() -> AsyncIterator[ClusterFactory]:
    """Start clusters of engines and gateways (tests/harness.py); all are closed after the test."""
    clusters: list[Cluster] = []

    async def make(*args: Any, **kwargs: Any) -> Cluster:
        cluster = await start_cluster(*args, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        await cluster.close()
