"""The cost of a Redis command through the gateway's client, with its sends under ``asyncio.timeout``
(gateway.redis_sending, which passes cancellations on) against redis-py's own ``asyncio.wait_for`` (which
makes a task for each send, and drops cancellations on Python 3.11). Sequential SETs on the same Redis,
interleaved rounds, medians, and the ratio in the same run.

    python tests/bench/bench_redis_send.py [--redis redis://127.0.0.1:6379/15] [--commands 5000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid

import redis.asyncio as aioredis

from gateway.redis_connection import REDIS_TIMEOUT_S
from gateway.redis_sending import connection_class


def client(url: str, cancellable: bool) -> aioredis.Redis:
    options: dict[str, object] = {
        "max_connections": 4,
        "timeout": REDIS_TIMEOUT_S,
        "socket_timeout": REDIS_TIMEOUT_S,
        "socket_connect_timeout": REDIS_TIMEOUT_S,
    }
    if cancellable:
        options["connection_class"] = connection_class(url)
    return aioredis.Redis.from_pool(aioredis.BlockingConnectionPool.from_url(url, **options))


async def per_command_us(redis: aioredis.Redis, key: str, commands: int) -> float:
    started = time.perf_counter()
    for _ in range(commands):
        await redis.set(key, b"v")
    return (time.perf_counter() - started) / commands * 1e6


async def main(url: str, commands: int, rounds: int) -> None:
    key = f"kvgate-bench-{uuid.uuid4().hex}"
    clients = {"wait_for (redis-py)": client(url, False), "asyncio.timeout (kvgate)": client(url, True)}
    times: dict[str, list[float]] = {name: [] for name in clients}
    for redis in clients.values():
        await per_command_us(redis, key, 200)  # (connected and warm)
    for _ in range(rounds):
        for name, redis in clients.items():
            times[name].append(await per_command_us(redis, key, commands))
    for name, values in times.items():
        spread = f"{min(values):.1f}-{max(values):.1f}"
        print(f"{name:26s} {statistics.median(values):7.1f} us a command ({spread})")
    old, new = (statistics.median(v) for v in times.values())
    print(f"ratio kvgate / redis-py: {new / old:.2f}")
    for redis in clients.values():
        await redis.delete(key)
        await redis.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--commands", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(main(args.redis, args.commands, args.rounds))
