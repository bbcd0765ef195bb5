"""Gateways on a real Redis Cluster (three masters, started here): with ``gateway.redis_cluster`` they
share sessions, the usage ledger and the residency mirror as on one Redis server, the scripts they pipeline
run on every node, and the kinds of Redis that do not match the setting stop the start in one line.

Before ``redis_cluster`` a gateway on a cluster node used a plain client: the residency index's slot
lived on another node (``shared-state write failed: 9682 127.0.0.1:<port>``, MOVED, every second; /health
``redis_unreachable``), session claims failed alike (a second turn through another gateway was routed
``least_load``, not ``session``), and the ledger worked only when its slot happened to be that node's."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from cache.ledger import UsageRecord, day_name
from cache.ledger_redis import RedisLedger
from cache.redis_keys import RedisKeys
from cache.residency_redis import RedisResidencyIndex
from cache.sessions import SessionBinding
from cache.sessions_redis import RedisSessionStore
from gateway.demo import free_port
from gateway.redis_connection import REDIS_TIMEOUT_S, WaitingRedisCluster, redis_client
from gateway.tenancy.tenants import create_key
from tests.gateway.test_cli import KVGATE, _distinct_ports
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.redis_cluster_process import RedisClusterProcesses, cluster_ports, tools_missing
from tests.redis_prefixes import new_prefix
from tests.redis_process import RedisProcess


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcesses]:
    why = tools_missing()
    if why is not None:
        pytest.skip(f"a Redis Cluster needs redis-server and redis-cli: {why}")
    nodes = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def _owner(nodes: RedisClusterProcesses, key: str) -> str:
    """The URL of the node that serves ``key``'s slot."""
    slot = key_slot(key.encode())
    with redis.Redis.from_url(nodes.urls[0], decode_responses=True) as client:
        for start, end, (host, port, *_), *_ in client.execute_command("CLUSTER SLOTS"):
            if start <= slot <= end:
                return f"redis://{host}:{port}"
    raise AssertionError(f"no node serves slot {slot}")


def chat(content: str) -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


async def _two_gateways(make_cluster: ClusterFactory, url: str, prefix: str) -> tuple[Cluster, str]:
    """Two gateways of one region (2 engines) on the cluster at ``url``, routing by session: the cluster
    and the second gateway's URL."""
    shared = {
        "redis_url": url,
        "redis_cluster": True,
        "redis_prefix": prefix,
        "routing": {"policy": "session"},
    }
    cluster = await make_cluster({"eu-west": 2}, **shared)
    _, second = await cluster.add_gateway("eu-west", **shared)
    return cluster, second


async def test_two_gateways_on_a_cluster_share_sessions_the_ledger_and_residency(
    make_cluster: ClusterFactory, redis_cluster: RedisClusterProcesses, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    prefix = new_prefix()
    # Connected through a node that serves neither the residency index nor the ledger: every key the
    # gateways use beyond the node's own slots comes through the cluster's redirections.
    holders = {_owner(redis_cluster, f"{{{prefix}:kv}}"), _owner(redis_cluster, f"{{{prefix}:ledger}}")}
    url = next((u for u in redis_cluster.urls if u not in holders), redis_cluster.urls[0])
    cluster, second = await _two_gateways(make_cluster, url, prefix)
    turns = 12  # sessions spread over the cluster's three nodes (one key each, by its own hash tag)
    for n in range(turns):
        headers = {"x-session-affinity": f"conversation-{n}"}
        status, _, first = await cluster.post(
            "/v1/chat/completions", chat(f"turn one of {n}"), headers=headers
        )
        assert status == 200
        status, _, other = await cluster.post(
            "/v1/chat/completions", chat(f"turn one of {n}, and two"), url=second, headers=headers
        )
        assert status == 200
        assert (other["x-kvgate-engine"], other["x-kvgate-route"]) == (first["x-kvgate-engine"], "session"), n

    client = RedisCluster.from_url(url)
    try:
        ledger = RedisLedger(client, prefix)
        today = day_name(int(time.time() // 86_400))
        deadline = time.monotonic() + 10
        while sum(d.requests for d in await ledger.daily("default", today, today)) < 2 * turns:
            assert time.monotonic() < deadline, await ledger.daily("default", today, today)
            await asyncio.sleep(0.05)
        assert sum(d.requests for d in await ledger.daily("default", today, today)) == 2 * turns
        index = RedisResidencyIndex(client, RedisKeys(prefix))
        assert await index.engines() == ["eu-west/e0", "eu-west/e1"]  # the mirror of the engines' KV events
    finally:
        await client.aclose()
    assert cluster.session is not None
    async with cluster.session.get(f"{second}/v1/admin/usage") as r:
        assert (r.status, (await r.json())["total"]["requests"]) == (200, 2 * turns)
    async with cluster.session.get(f"{second}/health") as r:
        health = await r.json()
        assert (health["status"], health["redis"]) == ("ok", "on")
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING] == []


async def test_pipelined_scripts_run_on_nodes_that_never_loaded_them(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """A cluster pipeline sends EVALSHA as it is: a node without the script (new, restarted, failed over)
    refused it with NOSCRIPT (the ledger's batches went to the spool, a rebuild's session offers failed)."""
    client = RedisCluster.from_url(redis_cluster.urls[0])
    prefix = new_prefix()
    try:
        await client.script_flush()
        ledger = RedisLedger(client, prefix)
        records = [
            UsageRecord(f"rec-{i}", "acme", MODEL, prompt_tokens=10, cached_tokens=0, completion_tokens=1,
                        cost_picodollars=0)
            for i in range(5)
        ]  # fmt: skip
        assert await ledger.record_many(records) == 5
        assert await ledger.record_many(records) == 0  # claimed by id: a replay counts once
        sessions = RedisSessionStore(client, RedisKeys(prefix))
        await client.script_flush()
        items = [(("acme", f"s{i}"), SessionBinding("r", f"e{i % 2}", 1.0 + i)) for i in range(12)]
        held = await sessions.offer_many(items)
        assert [h.binding for h in held] == [binding for _, binding in items]
        assert [h.binding for h in await sessions.read_many([k for k, _ in items])] == [b for _, b in items]
    finally:
        await client.aclose()


async def test_a_burst_beyond_the_pool_waits_for_a_connection_on_a_cluster(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """More commands at once than ``redis_max_connections`` wait for a free connection, as on one Redis
    server (its BlockingConnectionPool). redis-py's cluster nodes raise MaxConnectionsError instead: a burst
    of requests beyond the pool failed every command past its size, pipelines included."""
    client = redis_client(redis_cluster.urls[0], 3, cluster=True)
    key = f"{{{new_prefix()}}}:empty"  # one slot, so one node's pool
    try:
        popped = await asyncio.gather(*(client.blpop([key], timeout=0.05) for _ in range(12)))
        assert popped == [None] * 12

        async def pipelined(i: int) -> list[object]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.blpop([key], timeout=0.05)
                pipe.incr(f"{key}:{i}")
                return list(await pipe.execute())

        assert await asyncio.gather(*(pipelined(i) for i in range(8))) == [[None, 1]] * 8
    finally:
        await client.aclose()


async def test_a_burst_of_keys_the_gateway_has_not_verified_is_answered_on_a_cluster(
    make_cluster: ClusterFactory, redis_cluster: RedisClusterProcesses
) -> None:
    """A gateway just started on a cluster, met by many clients at once, reads each key it has not verified
    from Redis: more reads at once than redis_max_connections. They used to fail past the pool as Redis
    being unreachable: "cannot verify now" (503) for most of the burst."""
    cluster = await make_cluster(
        {"eu-west": 1},
        auth={"enabled": True},
        redis_url=redis_cluster.urls[0],
        redis_cluster=True,
        redis_prefix=new_prefix(),
        redis_max_connections=2,
    )
    store = cluster.gateway.billing.keys
    keys = [(await create_key(store, "default"))[0] for _ in range(40)]
    answers = await asyncio.gather(
        *(
            cluster.post("/v1/chat/completions", chat(f"hello {i}"), headers={"Authorization": f"Bearer {k}"})
            for i, k in enumerate(keys)
        )
    )
    assert [status for status, _, _ in answers] == [200] * len(keys)


async def test_a_cluster_command_waits_for_room_no_longer_than_the_redis_timeout(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """The wait is bounded as the blocking pool's is: with every connection busy past REDIS_TIMEOUT_S, a
    command fails as Redis being unavailable (the gateway's outage handling), not by hanging the request."""
    client = redis_client(redis_cluster.urls[0], 2, cluster=True)
    try:
        assert isinstance(client, WaitingRedisCluster)
        for _ in range(2):
            await client.room.acquire()  # every connection's worth of room held, as by slow commands
        started = time.monotonic()
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await client.get(f"{{{new_prefix()}}}:k")
        assert REDIS_TIMEOUT_S <= time.monotonic() - started < REDIS_TIMEOUT_S + 1
    finally:
        await client.aclose()


def _serve(tmp_path: Path, redis_lines: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``kvgate serve`` of one engine (not running: the start does not wait for engines) and ``redis_lines``
    in [gateway]; its exit within 30 s (a gateway that serves instead is killed: a TimeoutExpired)."""
    config = tmp_path / "deploy.toml"
    config.write_text(
        'region = "r"\n[[regions]]\nname = "r"\nengines = [{ name = "e0", url = "http://127.0.0.1:9" }]\n'
        f'[gateway]\nport = {_distinct_ports()[1]}\nspool_path = "{tmp_path / "spool"}"\n{redis_lines}'
    )
    return subprocess.run(
        [*KVGATE, "serve", "--config", str(config), *args], capture_output=True, text=True, timeout=30
    )


def test_a_plain_client_on_a_cluster_node_stops_the_start_in_one_line(
    tmp_path: Path, redis_cluster: RedisClusterProcesses
) -> None:
    result = _serve(tmp_path, f'redis_url = "{redis_cluster.urls[0]}"\nredis_prefix = "{new_prefix()}"\n')
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"kvgate: configuration error: gateway.redis_url / --redis: Redis at {redis_cluster.urls[0]} is a "
        "Redis Cluster node: set gateway.redis_cluster = true (--redis-cluster, KVGATE_REDIS_CLUSTER=1) so "
        "that the gateway follows the cluster's slots"
    )


def test_redis_cluster_on_one_redis_server_stops_the_start_in_one_line(tmp_path: Path) -> None:
    if tools_missing() is not None:
        pytest.skip(f"needs redis-server: {tools_missing()}")
    server = RedisProcess(tmp_path)
    server.start()
    try:
        url = f"redis://127.0.0.1:{server.port}"
        result = _serve(tmp_path, f'redis_url = "{url}"\n', "--redis-cluster")
    finally:
        server.stop()
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line == (
        f"kvgate: configuration error: gateway.redis_cluster = true, but Redis at {url} is not a Redis "
        "Cluster node: set redis_cluster = false (or leave it out) for one Redis server"
    )


def test_kvgate_usage_reads_the_ledger_through_any_node_of_the_cluster(
    redis_cluster: RedisClusterProcesses,
) -> None:
    prefix = new_prefix()
    holder = _owner(redis_cluster, f"{{{prefix}:ledger}}")
    elsewhere = next(u for u in redis_cluster.urls if u != holder)
    record = UsageRecord("rec-1", "acme", MODEL, prompt_tokens=7, cached_tokens=0, completion_tokens=3,
                         cost_picodollars=0)  # fmt: skip

    async def write() -> None:
        client = RedisCluster.from_url(elsewhere)
        try:
            assert await RedisLedger(client, prefix).record(record)
        finally:
            await client.aclose()

    asyncio.run(write())
    usage = [*KVGATE, "usage", "--redis", elsewhere, "--redis-prefix", prefix]
    result = subprocess.run([*usage, "--redis-cluster"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("acme")]
    assert row.split()[2:4] == ["1", "7"]  # requests, prompt tokens
    result = subprocess.run(usage, capture_output=True, text=True, timeout=30)  # a plain client: MOVED
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"kvgate usage: Redis at {elsewhere} is a Redis Cluster node: add --redis-cluster (or set "
        "gateway.redis_cluster = true in --config's file)"
    ]


async def test_a_cluster_that_cannot_be_reached_is_an_outage_not_a_failure(
    make_cluster: ClusterFactory,
) -> None:
    """redis-py's cluster client says "cannot be connected" with a RedisClusterException, which is no
    RedisError: the gateway's outage handling let it through (500s) until it caught both."""
    port = cluster_ports(1)[0]  # nothing listens there
    cluster = await make_cluster(
        {"eu-west": 2}, redis_url=f"redis://127.0.0.1:{port}", redis_cluster=True, redis_prefix=new_prefix()
    )
    status, _, _ = await cluster.post(
        "/v1/chat/completions", chat("hello"), headers={"x-session-affinity": "s"}
    )
    assert status == 200  # served from this gateway's own view; usage spooled
    assert cluster.session is not None
    async with cluster.session.get(f"{cluster.url}/v1/admin/usage") as r:
        assert r.status == 503
        assert "cannot be read right now" in (await r.json())["error"]["message"]
    async with cluster.session.get(f"{cluster.url}/health") as r:
        health = await r.json()
        assert (health["status"], health["redis"]) == ("degraded", "unreachable")


@pytest.fixture
def redis_cluster_with_replicas(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """Three masters, each with a replica promoted a second after its master stops answering."""
    why = tools_missing()
    if why is not None:
        pytest.skip(f"a Redis Cluster needs redis-server and redis-cli: {why}")
    nodes = RedisClusterProcesses(tmp_path, replicas=1, node_timeout_ms=1000)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


async def test_a_failover_of_the_ledgers_master_loses_no_usage_and_sessions_go_on(
    make_cluster: ClusterFactory, redis_cluster_with_replicas: RedisClusterProcesses
) -> None:
    """The master serving the ledger's slot crashes; its replica takes over. The gateways answer all the
    while, the usage of requests served during the failover is billed once the new master answers, and
    conversations begun after it go on through the other gateway (their bindings are in Redis again)."""
    nodes = redis_cluster_with_replicas
    prefix = new_prefix()
    ledger_key = f"{{{prefix}:ledger}}"
    doomed = nodes.master_of(ledger_key)
    url = next(u for u in nodes.urls if not u.endswith(f":{doomed}"))
    cluster, second = await _two_gateways(make_cluster, url, prefix)
    served = 0

    async def turn(n: int, text: str, at: str | None = None) -> dict[str, str]:
        nonlocal served
        status, _, headers = await cluster.post(
            "/v1/chat/completions", chat(text), url=at, headers={"x-session-affinity": f"conversation-{n}"}
        )
        assert status == 200, n
        served += 1
        return dict(headers)

    for n in range(3):
        await turn(n, f"before the crash {n}")
    nodes.kill(doomed)
    for n in range(3, 6):  # the ledger's slot has no master until the replica is promoted
        await turn(n, f"during the failover {n}")
    deadline = time.monotonic() + 30
    while nodes.master_of(ledger_key) == doomed:
        assert time.monotonic() < deadline, "the replica was not promoted"
        await asyncio.sleep(0.1)
    promoted = time.monotonic()

    client = RedisCluster.from_url(url)
    try:
        ledger = RedisLedger(client, prefix)
        today = day_name(int(time.time() // 86_400))
        # Until the gateways' clients learn the new master (a second or so), a binding written to the old
        # one is lost and the second turn is routed afresh: conversations begun after that go on.
        shared_in_a_row, n = 0, 6
        while shared_in_a_row < 5:
            assert time.monotonic() < promoted + 15, "sessions are not shared again after the failover"
            first = await turn(n, f"after the failover {n}")
            other = await turn(n, f"after the failover {n}, and two", at=second)
            shared = (other["x-kvgate-engine"], other["x-kvgate-route"]) == (
                first["x-kvgate-engine"],
                "session",
            )
            shared_in_a_row = shared_in_a_row + 1 if shared else 0
            n += 1
        deadline = time.monotonic() + 30
        while sum(d.requests for d in await ledger.daily("default", today, today)) < served:
            assert time.monotonic() < deadline, (await ledger.daily("default", today, today), served)
            await asyncio.sleep(0.1)
        assert sum(d.requests for d in await ledger.daily("default", today, today)) == served
    finally:
        await client.aclose()
    assert cluster.session is not None
    deadline = time.monotonic() + 15
    for gateway in (cluster.url, second):
        while True:
            async with cluster.session.get(f"{gateway}/health") as r:
                health = await r.json()
            if (health["status"], health["redis"]) == ("ok", "on"):
                break
            assert time.monotonic() < deadline, health
            await asyncio.sleep(0.1)


def test_the_demo_runs_on_a_cluster(redis_cluster: RedisClusterProcesses, tmp_path: Path) -> None:
    """``kvgate demo --redis NODE --redis-cluster``: its gateway keeps its state in the cluster. The demo had
    no such flag, and its start stopped at "is a Redis Cluster node: add --redis-cluster"."""
    port = free_port()
    demo = subprocess.Popen(
        [*KVGATE, "demo", "--simulated", "--port", str(port), "--regions", "1", "--engines-per-region", "1",
         "--redis", redis_cluster.urls[1], "--redis-cluster"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        health: dict[str, object] | None = None
        while health is None:
            assert demo.poll() is None, demo.communicate()[1]
            assert time.monotonic() < deadline, "the demo gateway never answered"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    health = json.loads(r.read())
            except OSError:
                time.sleep(0.2)
        assert (health["status"], health["redis"]) == ("ok", "on")
        answer = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"
        ).chat.completions.create(
            model="kvgate-sim", messages=[{"role": "user", "content": "hello"}], max_tokens=2
        )
        assert answer.usage is not None and answer.usage.completion_tokens == 2
    finally:
        demo.send_signal(signal.SIGINT)
        demo.wait(timeout=30)
    assert demo.returncode == 0
