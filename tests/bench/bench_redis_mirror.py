"""What mirroring KV events into Redis costs: the gateway's CPU, Redis's CPU and the wall time per event.

    python tests/bench/bench_redis_mirror.py [--redis redis://127.0.0.1:6379/0] [--blocks 750] [--events 60]

Every gateway with Redis writes each engine's KV events there (``SharedState.apply_events``) so that a
restarted gateway starts warm. Each event here is one prefill's churn: ``--blocks`` new blocks stored and as
many evicted, as one batch, through ``RedisResidencyIndex.apply``. For scale, the same events applied to the
in-process index (what every gateway does anyway) are timed in the same run and printed as a ratio. Redis's
CPU comes from ``INFO cpu`` before and after. Keys live under a prefix of their own and are removed after.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time

from redis.asyncio import Redis

from cache.events import BlockRemoved, BlockStored, KvEventBatch
from cache.redis_keys import RedisKeys
from cache.residency_memory import MemoryResidencyIndex
from cache.residency_redis import RedisResidencyIndex


def events(blocks: int, count: int) -> tuple[KvEventBatch, list[KvEventBatch], list[int]]:
    rng = random.Random(1)
    live = [rng.getrandbits(64) for _ in range(blocks)]
    first = KvEventBatch("e0", 0, 0.0, (BlockStored(tuple(live)),))
    batches = []
    for seq in range(1, count + 1):
        new = [rng.getrandbits(64) for _ in range(blocks)]
        batches.append(KvEventBatch("e0", seq, 0.0, (BlockStored(tuple(new)), BlockRemoved(tuple(live)))))
        live = new
    return first, batches, live


async def redis_cpu(redis: Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def run(url: str, blocks: int, count: int) -> None:
    first, batches, live = events(blocks, count)
    memory = MemoryResidencyIndex()
    memory.apply_now("e0", first)
    start = time.process_time()
    for batch in batches:
        memory.apply_now("e0", batch)
    memory_s = (time.process_time() - start) / count

    redis = Redis.from_url(url)
    index = RedisResidencyIndex(redis, RedisKeys(f"kvgate-bench-mirror-{os.getpid()}"))
    try:
        await index.apply("e0", first)
        cpu0, wall0, server0 = time.process_time(), time.perf_counter(), await redis_cpu(redis)
        for batch in batches:
            assert await index.apply("e0", batch)
        cpu1, wall1, server1 = time.process_time(), time.perf_counter(), await redis_cpu(redis)
        assert (await index.holdings("e0")).exact == frozenset(live), "the mirror lost track"
    finally:
        await index.clear("e0")
        await redis.aclose()
    gateway_s = (cpu1 - cpu0) / count
    print(f"{count} events of {blocks} blocks stored + {blocks} evicted, per event:")
    print(f"  gateway CPU {gateway_s * 1e3:.2f} ms (x{gateway_s / memory_s:.1f} the in-process index's "
          f"{memory_s * 1e3:.2f} ms), Redis CPU {(server1 - server0) / count * 1e3:.2f} ms, "
          f"wall {(wall1 - wall0) / count * 1e3:.2f} ms")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--blocks", type=int, default=750, help="blocks per prefill (12k tokens of 16)")
    parser.add_argument("--events", type=int, default=60)
    args = parser.parse_args()
    asyncio.run(run(args.redis, args.blocks, args.events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
