"""Kvgate as an operator runs it against Redis: several deployments on one server, the ledger's spool across
a gateway's crash and restart while Redis is away, and what the gateway says about the Redis URL it is
given. Every Redis here is a real ``redis-server`` (the tests' own where it is stopped or reconfigured)."""

from __future__ import annotations

import asyncio

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
