"""Shared fixtures: a real Redis server (never a mock; database 15 by default), each test under a key prefix
of its own (tests/redis_prefixes.py), and nothing written to the user's home directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis
import redis.asyncio as aioredis
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

import tests.triton_interpret  # noqa: F401  (first: Triton's import mode, before the engine imports it)
from cache.redis_keys import RedisKeys
from gateway import compiled
from gateway.user_errors import UserError
from tests.harness import Cluster, ClusterFactory, start_cluster
from tests.redis_prefixes import (
    ISSUED,
    REDIS_URL,
    TEST_PREFIX_MARK,
    delete_prefixes,
    keys_outside_test_prefixes,
    new_prefix,
)
from tests.redis_process import RedisProcess
from tests.third_party_engines import VllmLikeEngine


def pytest_report_header(config: pytest.Config) -> str:
    """Which build of the gateway's hot path the suite runs (``python -m gateway.compiled``)."""
    return f"kvgate hot path: {'compiled (mypyc)' if compiled.in_use() else 'pure Python'}"


def pytest_sessionstart(session: pytest.Session) -> None:
    """A compiled build older than its sources would test code that is not in the tree: refuse."""
    try:
        compiled.check_fresh()
    except UserError as exc:
        pytest.exit(str(exc), returncode=2)


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Tests run on uvloop, as the gateway and engines do in production."""
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session", autouse=True)
def _away_from_the_users_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What the gateways and the demo would write under the user's home (the demo's model in
    ``~/.cache/kvgate``, ledger spools in ``~/.local/state/kvgate``) goes to this session's temporary
    directory instead; subprocesses inherit it."""
    base = tmp_path_factory.mktemp("xdg")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(base / "cache"))
        patch.setenv("XDG_STATE_HOME", str(base / "state"))
        yield


@pytest.fixture(scope="session", autouse=True)
def _redis_hygiene() -> Iterator[None]:
    """Tests leave nothing in the tests' Redis: at the end of the session every key under a prefix this
    session handed out is deleted, and a key that appeared outside the test prefixes (``kvgate-test-*``)
    fails the run. Keys that were there before the session are not this session's business."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2, socket_timeout=30)
    try:
        before = keys_outside_test_prefixes(client)
    except (redis.RedisError, OSError):
        client.close()
        yield  # no Redis: the tests that need it fail on their own, saying so
        return
    try:
        yield
        delete_prefixes(client, ISSUED)
        new = sorted(keys_outside_test_prefixes(client) - before)
    finally:
        client.close()
    if new:
        shown = ", ".join(k.decode(errors="replace") for k in new[:10]) + (" ..." if len(new) > 10 else "")
        pytest.fail(
            f"Redis hygiene: the tests left {len(new)} key(s) in {REDIS_URL} outside the test prefixes "
            f"({TEST_PREFIX_MARK}*): {shown}. Give every gateway, CLI command and store a prefix from "
            "tests/redis_prefixes.py:new_prefix() (the redis_keys fixture, or Cluster.redis_prefix).",
            pytrace=False,
        )


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
    keys = RedisKeys(new_prefix())
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


ThirdPartyFleet = Callable[..., Awaitable[tuple[Cluster, dict[str, VllmLikeEngine]]]]


@pytest.fixture
async def third_party() -> AsyncIterator[ThirdPartyFleet]:
    """Start stand-ins of vLLM/SGLang engines (tests/third_party_engines.py; id -> constructor kwargs) and a
    gateway in front of them (``engine_options`` adds to or overrides their deployment-file entries)."""
    async with AsyncExitStack() as stack:

        async def make(
            engines: dict[str, dict[str, Any]], **gateway: Any
        ) -> tuple[Cluster, dict[str, VllmLikeEngine]]:
            started = {}
            for engine_id, kwargs in engines.items():
                started[engine_id] = await stack.enter_async_context(VllmLikeEngine(model="tiny", **kwargs))
            cluster = Cluster(engines={i: (e, e.url) for i, e in started.items()}, model="tiny")
            cluster.roles = {i: kw.get("role", "both") for i, kw in engines.items()}
            stack.push_async_callback(cluster.close)
            cluster.session = aiohttp.ClientSession()
            options = {
                i: {"kind": kw.get("kind", "vllm"), "block_size": kw.get("block_size", 32),
                    **({"bootstrap_port": e.bootstrap_port} if e.bootstrap_port else {})}
                for (i, kw), e in zip(engines.items(), started.values(), strict=True)
            }  # fmt: skip
            for engine_id, extra in gateway.pop("engine_options", {}).items():
                options[engine_id].update(extra)
            await cluster.add_gateway("eu-west", engine_options=options, **gateway)
            return cluster, started

        yield make
