"""The gateway's Redis client passes cancellations on: a task looping on commands (a writer, a follower, a
request whose client left) ends at the first cancellation whenever it comes, and the socket timeout still
bounds each command."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.redis_connection import REDIS_TIMEOUT_S, redis_client
from tests.redis_prefixes import new_prefix


async def test_a_task_looping_on_commands_ends_at_the_first_cancellation(redis_url: str) -> None:
    """redis-py sent each command under ``asyncio.wait_for``, which on Python 3.11 drops a cancellation that
    arrives as the send completes: 246 of 300 tasks cancelled at random instants carried on, and a gateway's
    stop waited on such a task for ever."""
    client = redis_client(redis_url, 4)
    key = f"{new_prefix()}:cancelled"

    async def write_forever() -> None:
        while True:
            await client.set(key, b"v")

    carried_on = 0
    try:
        for _ in range(300):
            task = asyncio.create_task(write_forever())
            await asyncio.sleep(random.random() * 0.005)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1)
            if not done:
                carried_on += 1
                while not task.done():  # (stopped, so that the next one starts alone)
                    task.cancel()
                    await asyncio.wait({task}, timeout=0.05 * (0.5 + random.random()))
        assert carried_on == 0, f"{carried_on} of 300 carried on past a cancellation"
        connection = await client.connection_pool.get_connection()
        try:
            assert connection.socket_timeout == REDIS_TIMEOUT_S  # (unset only while a command is sent)
        finally:
            await client.connection_pool.release(connection)
    finally:
        await client.delete(key)
        await client.aclose()


async def test_a_redis_that_never_answers_still_times_out() -> None:
    """A server that takes the connection and says nothing (a hung Redis): each command fails within the
    gateway's Redis timeout, as before, rather than waiting for ever."""
    silent: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        silent.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = redis_client(f"redis://127.0.0.1:{port}/0", 2)
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(RedisTimeoutError):
                await client.set("k", b"v")
            assert time.monotonic() - started < 3 * REDIS_TIMEOUT_S
    finally:
        await client.aclose()
        for writer in silent:
            writer.close()
        server.close()
