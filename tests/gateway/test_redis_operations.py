"""Kvgate as an operator runs it against Redis: several deployments on one server, the ledger's spool across
a gateway's crash and restart while Redis is away, and what the gateway says about the Redis URL it is
given. Every Redis here is a real ``redis-server`` (the tests' own where it is stopped or reconfigured)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import redis

from cache.ledger import UsageRecord
from cache.ledger_redis import RedisLedger
from cache.spool import Spool
from gateway.redis_connection import redis_client
from gateway.tenancy.ledger_writer import LedgerWriter
from tests.harness import MODEL, ClusterFactory
from tests.redis_process import RedisProcess

SYSTEM = "You are the support assistant of a large company; answer briefly and correctly. " * 8


def chat(content: str) -> dict[str, object]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
    return {"model": MODEL, "max_tokens": 4, "messages": messages}


# -- two deployments on one Redis -------------------------------------------------------------------------


async def test_deployments_in_two_databases_of_one_redis_do_not_hear_each_other(
    make_cluster: ClusterFactory, private_redis: RedisProcess
) -> None:
    """Pub/sub channels are global to a Redis server, whatever the database: a deployment in database 1
    must not take up the session bindings a deployment in database 0 announces under the same prefix."""
    db0, db1 = private_redis.url, private_redis.url.removesuffix("/0") + "/1"
    cluster = await make_cluster({"eu-west": 2}, redis_url=db0)
    witness, _ = await cluster.add_gateway("eu-west", redis_url=db0)  # the same deployment: it hears
    other, _ = await cluster.add_gateway("eu-west", redis_url=db1)  # another one, same prefix and engines
    status, _, _ = await cluster.post(
        "/v1/chat/completions", chat("hello"), headers={"x-session-affinity": "conversation-1"}
    )
    assert status == 200
    await cluster.wait_for(lambda: witness.state.sessions.peek_now("default", "conversation-1") is not None)
    await asyncio.sleep(0.2)  # (the same publish reached every subscriber of the channel)
    assert other.state.sessions.peek_now("default", "conversation-1") is None


# -- the ledger's spool across a crash and a restart ------------------------------------------------------


def usage(i: int) -> UsageRecord:
    return UsageRecord(f"r{i}", "acme", MODEL, 100, 20, 10, 1000 + i)


async def test_records_spooled_after_a_crash_tore_the_spool_are_billed(
    private_redis: RedisProcess, tmp_path: Path
) -> None:
    """A gateway killed while it appended to its spool (Redis away) leaves a torn last record; the gateway
    started after it, with Redis still away, spools behind that tail. Once Redis answers, every whole
    record is billed: none appended after the tear is read as its rest and lost."""
    path = tmp_path / "ledger.spool"
    Spool(path).append([usage(1), usage(2)])
    with path.open("ab") as f:
        f.write(b"\x8f\xa9record_id")  # the killed process's next append, cut short
    private_redis.stop()
    client = redis_client(private_redis.url, 4)
    writer = LedgerWriter(RedisLedger(client, "kvgate-spool"), Spool(path), retry_s=0.05)
    await writer.start()  # the restart: Redis is still away
    assert writer.degraded
    for i in (3, 4):
        writer.submit(usage(i))
    await writer.stop()
    private_redis.start()
    writer = LedgerWriter(RedisLedger(client, "kvgate-spool"), Spool(path))
    await writer.start()  # the next start, Redis back: the spool is replayed
    await writer.stop()
    ledger = RedisLedger(client, "kvgate-spool")
    assert sorted(r.record_id for r in await ledger.records()) == ["r1", "r2", "r3", "r4"]
    assert Spool(path).read() == []
    await client.aclose()


# -- what the gateway says about the Redis it is given ----------------------------------------------------

EVICTING = ["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        (EVICTING, "allkeys-lru"),
        (["--maxmemory", "100mb", "--maxmemory-policy", "volatile-lru"], "volatile-lru"),
        (["--maxmemory", "100mb", "--maxmemory-policy", "noeviction"], None),
        (["--maxmemory-policy", "allkeys-lru"], None),  # no maxmemory: nothing is ever evicted
        ([*EVICTING, "--rename-command", "CONFIG", ""], None),  # CONFIG refused, as managed Redis does
    ],
    ids=["allkeys-lru", "volatile-lru", "noeviction", "no-maxmemory", "config-refused"],
)
async def test_a_redis_that_may_evict_the_ledger_is_named_at_start(
    make_cluster: ClusterFactory,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    args: list[str],
    warned: str | None,
) -> None:
    server = RedisProcess(tmp_path, args)
    server.start()
    try:
        if "--rename-command" in args:  # (the case is real: that Redis answers CONFIG with an error)
            with pytest.raises(redis.ResponseError), redis.Redis(port=server.port) as client:
                client.config_get("maxmemory*")
        caplog.set_level(logging.WARNING, logger="kvgate.app")
        cluster = await make_cluster({"eu-west": 1}, redis_url=server.url)
        said = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        if warned is None:
            assert said == []
        else:
            [line] = said
            assert f"maxmemory-policy {warned}" in line and "noeviction" in line
            assert "ledger" in line and server.url in line
        status, _, _ = await cluster.post("/v1/chat/completions", chat("hello"))
        assert status == 200 and cluster.gateway.health_report.redis_status() == "on"
    finally:
        server.stop()


async def test_health_says_degraded_while_redis_is_away_and_ok_once_it_is_back(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A gateway whose Redis is away still serves (200: a load balancer keeps it), but its sessions are not
    shared, its usage goes to the spool and unknown keys get 503. /health's status said "ok" all along, so
    a check of that field (or a glance at it) saw nothing wrong; it says "degraded", and why, until Redis
    is back."""
    server = RedisProcess(tmp_path)
    server.start()
    try:
        cluster = await make_cluster({"eu-west": 1}, redis_url=server.url)
        assert cluster.session is not None

        async def health() -> tuple[int, dict[str, object]]:
            async with cluster.session.get(cluster.url + "/health") as r:  # type: ignore[union-attr]
                return r.status, await r.json()

        status, body = await health()
        assert (status, body["status"], body["redis"]) == (200, "ok", "on"), body
        server.stop()
        assert (await cluster.post("/v1/chat/completions", chat("while Redis is away")))[0] == 200
        await cluster.wait_for(lambda: cluster.gateway.health_report.redis_status() == "unreachable")
        await cluster.wait_for(lambda: cluster.gateway.billing.writer.state == "spooling")
        status, body = await health()
        assert status == 200, body
        assert body["status"] == "degraded", body
        assert body["degraded"] == ["redis_unreachable", "ledger_spooling"], body
        server.start()
        await cluster.wait_for(
            lambda: (
                cluster.gateway.health_report.redis_status() == "on"
                and cluster.gateway.billing.writer.state == "ok"
            ),
            within_s=30,
        )
        status, body = await health()
        assert (status, body["status"], body["degraded"]) == (200, "ok", []), body
    finally:
        server.stop()
