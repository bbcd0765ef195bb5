"""The Redis clients kvgate's stores accept: one server's (``redis.asyncio.Redis``) or a Redis Cluster's
(``redis.asyncio.cluster.RedisCluster``, which follows the cluster's redirections).

Every multi-key command and script of the stores keeps its keys in one hash slot (their ``{...}`` hash
tags: ``cache.redis_keys``), so each runs on one node of a cluster as it does on one server. Pipelines that
mix slots (sessions, which spread over the cluster) are split by node by the cluster client.

A cluster client that reaches no node raises ``RedisClusterException`` ("cannot be connected"), which is no
``RedisError``: the code that treats a failing Redis as an outage (serve from the view, spool, 503) catches
both.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

AnyRedis: TypeAlias = Redis | RedisCluster

# What a failing Redis raises, for the code that then serves on without it (the view, the spool, a 503): a
# server's errors, a cluster client's that reached no node (no RedisError), and the socket's own.
REDIS_FAILURES: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
# ... and a caller's own deadline (asyncio.timeout) around a Redis call.
REDIS_FAILURES_OR_LATE: tuple[type[Exception], ...] = (*REDIS_FAILURES, TimeoutError)


async def run_scripts_pipelined(
    redis: AnyRedis, scripts: Sequence[AsyncScript], queue: Callable[[Any], Awaitable[None]]
) -> list[Any]:
    """Run the script calls ``queue`` puts in a pipeline, in one round trip (per node on a cluster).

    A server's pipeline loads the scripts it lacks itself. A cluster's sends EVALSHA as it is, and a node
    that never ran the script (or lost it: a restart, a failover) refuses it: the scripts are then loaded on
    every primary and the pipeline sent again once. What the stores pipeline so is safe to repeat: ledger
    records are claimed by id, session offers are newest-wins."""
    for attempt in range(2):
        async with redis.pipeline(transaction=False) as pipe:
            await queue(pipe)
            try:
                return list(await pipe.execute())
            except NoScriptError:
                if attempt or not isinstance(pipe, ClusterPipeline):
                    raise
        assert isinstance(redis, RedisCluster)
        for script in scripts:
            await redis.script_load(script.script)
    raise AssertionError("unreachable")
