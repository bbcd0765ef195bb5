"""The gateway's Redis connection: its one client (one server's, or a Redis Cluster's with
``gateway.redis_cluster``), and the check at start that says whether Redis is there, whether it refuses the
URL, whether it is the kind of Redis the settings say (a cluster node for a plain client refuses most keys
with MOVED), and whether it may evict what the usage ledger keeps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError

from cache.redis_client import REDIS_FAILURES_OR_LATE, AnyRedis
from gateway.redis_sending import connection_class
from gateway.state.shared_state import SharedState
from gateway.user_errors import without_credentials
from region_map.config import ConfigError

log = logging.getLogger("kvgate.app")

REDIS_TIMEOUT_S = 2.0  # connecting, each reply, and waiting for a free pooled connection
REDIS_START_PING_S = 1.0  # the one PING at start that says whether Redis is there


def redis_client(url: str, max_connections: int, *, cluster: bool = False) -> AnyRedis:
    """The gateway's one Redis client: keys, ledger, rate-limit buckets and shared state (pub/sub too) all
    use it. Its pool is sized for the gateway's concurrency, and a burst beyond that waits for a free
    connection (up to the socket timeout) rather than failing with "Too many connections", which redis-py's
    default pool (100) does. A command that finds its pooled connection dead (Redis restarted) is sent once
    more on a fresh one, instead of failing the request that happened to draw it.

    ``cluster``: ``url`` is one node of a Redis Cluster; the client learns the others from it at its first
    command; at most ``max_connections`` commands are in flight at once, the rest wait for room as above
    (``WaitingRedisCluster``), and each node's pool has two connections spare beyond them."""
    if cluster:
        return _cluster_client(url, max_connections)
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=REDIS_TIMEOUT_S,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        connection_class=connection_class(url),  # (cancellable sends: gateway.redis_sending)
    )
    return aioredis.Redis.from_pool(pool)  # closing the client closes the pool


# Connections a cluster node may open beyond the commands in flight: the pub/sub follower's, and the one the
# client takes from a node to re-read the cluster's slots. Neither goes through ``execute_command``.
CLUSTER_SPARE_CONNECTIONS = 2
_HOLDS_ROOM: ContextVar[bool] = ContextVar("kvgate_redis_cluster_room", default=False)


class WaitingRedisCluster(RedisCluster):
    """A cluster client whose commands wait for room, as one server's BlockingConnectionPool does.

    redis-py's cluster nodes raise MaxConnectionsError at once when their pool is in use, so a burst of
    requests beyond ``max_connections`` failed every command past it. Here at most ``room`` commands and
    pipelines are in flight at once (each holds at most one connection of any node), the rest wait up to
    ``REDIS_TIMEOUT_S``; a command a pipeline sends again on its own (after a redirection) is inside its
    pipeline's room and does not wait for a second."""

    room: asyncio.Semaphore

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        async with _room(self.room):
            return await super().execute_command(*args, **kwargs)

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _WaitingPipeline(self, transaction)  # type: ignore[abstract]  # (as redis-py builds its own)


class _WaitingPipeline(ClusterPipeline):
    cluster_client: WaitingRedisCluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        async with _room(self.cluster_client.room):
            return await super().execute(raise_on_error, allow_redirections)


@asynccontextmanager
async def _room(room: asyncio.Semaphore) -> AsyncIterator[None]:
    if _HOLDS_ROOM.get():
        yield
        return
    if room.locked():
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await room.acquire()
        except TimeoutError:
            raise RedisConnectionError("No connection available.") from None  # (the blocking pool's words)
    else:
        await room.acquire()  # (free: returns without yielding to the loop)
    holding = _HOLDS_ROOM.set(True)
    try:
        yield
    finally:
        _HOLDS_ROOM.reset(holding)
        room.release()


def _cluster_client(url: str, max_connections: int) -> WaitingRedisCluster:
    client = WaitingRedisCluster.from_url(
        url,
        max_connections=max_connections + CLUSTER_SPARE_CONNECTIONS,
        socket_timeout=REDIS_TIMEOUT_S,
        socket_connect_timeout=REDIS_TIMEOUT_S,
    )
    assert isinstance(client, WaitingRedisCluster)  # (from_url is typed as building the base class)
    client.room = asyncio.Semaphore(max_connections)
    # Each node's connections are built from these arguments: the same cancellable sends as a server's.
    client.connection_kwargs["connection_class"] = connection_class(url)
    return client


def redis_db(redis: AnyRedis | None) -> int:
    """The database number ``redis`` selects (0 without Redis, and on a cluster, which has no other)."""
    if redis is None or isinstance(redis, RedisCluster):
        return 0
    return int(redis.connection_pool.connection_kwargs.get("db") or 0)


async def check_redis(state: SharedState, url: str) -> str:
    """One PING at start, so that the start is told the truth: "on (URL)", or "unreachable at URL". An
    unreachable Redis marks the shared-state writer failing: it then PINGs every second, and ``/health``
    says "unreachable" until Redis answers. A Redis that answers and refuses the URL stops the start, as
    does one that is not the kind ``gateway.redis_cluster`` says."""
    assert state.redis is not None
    try:
        async with asyncio.timeout(REDIS_START_PING_S):
            await state.redis.ping()
    except REDIS_FAILURES_OR_LATE as exc:
        if "cluster mode is not enabled" in str(exc).lower():  # (a cluster client's first command)
            raise ConfigError(
                f"gateway.redis_cluster = true, but Redis at {without_credentials(url)} is not a Redis "
                "Cluster node: set redis_cluster = false (or leave it out) for one Redis server"
            ) from None
        if _refuses_url(exc):
            raise ConfigError(
                f"gateway.redis_url / --redis: Redis at {without_credentials(url)} refuses it: "
                f"{str(exc).rstrip('.')}"
            ) from None
        state.writer.failing = True
        reason = str(exc).rstrip(".") or f"no answer within {REDIS_START_PING_S:g} s"
        log.warning(
            "redis unreachable at %s: %s; serving from this gateway's own view (sessions, residency; usage "
            "goes to the spool) until it answers. Start Redis there, or fix gateway.redis_url / --redis",
            without_credentials(url),
            reason,
        )
        return f"unreachable at {without_credentials(url)}"
    await _check_kind(state.redis, url)
    await _check_eviction(state.redis, url)
    return f"on ({without_credentials(url)})"


async def _check_kind(redis: AnyRedis, url: str) -> None:
    """A plain client on a cluster node is answered MOVED for every key another node serves: most of the
    sessions, and the residency index or the ledger unless their slots happen to be that node's. Refuse
    that at start in one line (one INFO at start; requests pay nothing for it)."""
    if isinstance(redis, RedisCluster):
        return  # (its first command already asked the node for the cluster's slots)
    try:
        async with asyncio.timeout(REDIS_START_PING_S):
            info = await redis.info("cluster")
    except (RedisError, OSError, TimeoutError) as exc:  # (a Redis that refuses INFO: not asked again)
        log.debug("could not ask Redis whether it is a cluster node: %s", exc)
        return
    if str(info.get("cluster_enabled", 0)) == "1":
        raise ConfigError(
            f"gateway.redis_url / --redis: Redis at {without_credentials(url)} is a Redis Cluster node: set "
            "gateway.redis_cluster = true (--redis-cluster, KVGATE_REDIS_CLUSTER=1) so that the gateway "
            "follows the cluster's slots"
        )


# What each family of eviction policies may take from the ledger (``maxmemory-policy``, when Redis is full).
EVICTION_RISKS = {
    "allkeys": "any key: the usage ledger's daily sums and its stream, and the ids of records it already "
    "counted",
    "volatile": "keys with a TTL: the ids of records the usage ledger already counted",
}


async def _check_eviction(redis: AnyRedis, url: str) -> None:
    """Warn once, at start, when Redis may evict keys once it is full: the ledger's sums can then vanish,
    and a record whose id was evicted counts twice when a spool or a journal replays it. A Redis that
    refuses CONFIG (managed ones often do) or does not answer in time is not asked again."""
    try:
        async with asyncio.timeout(REDIS_START_PING_S):
            config = await redis.config_get("maxmemory*")
        policy, maxmemory = str(config["maxmemory-policy"]), int(str(config["maxmemory"]))
    except (RedisError, OSError, TimeoutError, KeyError, ValueError) as exc:
        log.debug("could not read Redis's eviction policy: %s", exc)
        return
    if policy == "noeviction" or maxmemory == 0:  # (no maxmemory: Redis never evicts)
        return
    risk = EVICTION_RISKS.get(policy.split("-")[0], "keys the gateways rely on")
    log.warning(
        "redis at %s runs with maxmemory-policy %s (maxmemory %d bytes): once full it evicts %s, so usage "
        "can vanish from the ledger or a replayed record count twice. Run the ledger's Redis with "
        "maxmemory-policy noeviction (a full Redis then refuses writes, and usage goes to the spool)",
        without_credentials(url),
        policy,
        maxmemory,
        risk,
    )


def _refuses_url(exc: BaseException) -> bool:
    """Whether Redis answered and refused the URL itself (a wrong password or user, a database it does not
    have): no waiting fixes that, and a gateway serving meanwhile would only spool its usage. A busy or full
    Redis, or one that does not answer, is waited for."""
    if isinstance(exc, AuthenticationError | NoPermissionError):
        return True
    return isinstance(exc, ResponseError) and "DB index" in str(exc)  # (SELECT's "DB index is out of range")
