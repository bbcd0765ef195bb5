"""A request queued behind others at a busy engine is not taken for an engine's silence and failed over."""

from __future__ import annotations

import asyncio
from typing import Any

from region_map.breaker import BreakerState
from tests.harness import MODEL, ClusterFactory

PREFILL_S_PER_TOKEN = 0.002  # the engine's, and the gateway's estimate of it


def chat(i: int) -> dict[str, Any]:
    # ~260 prompt tokens of its own (none shared with the others'): ~0.5 s of prefill each.
    words = " ".join(f"w{i}x{j}" for j in range(40))
    return {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": words}]}


async def test_a_request_queued_past_the_first_byte_limit_is_not_failed_over(
    make_cluster: ClusterFactory,
) -> None:
    # One engine that prefills one prompt at a time and sends a stream's header with its first token, as
    # kvgate's engines do; a first-byte limit shorter than the queue the third of three prompts waits in.
    cluster = await make_cluster(
        {"eu-west": 1},
        sim={"max_running": 1, "prefill_s_per_token": PREFILL_S_PER_TOKEN, "decode_s_per_token": 0.0},
        routing={"prefill_s_per_token": PREFILL_S_PER_TOKEN},
        resilience={"first_byte_timeout_s": 0.3, "s_per_output_token": 0.0, "max_attempts": 1},
    )
    assert cluster.session is not None

    async def one(i: int) -> tuple[int, str]:
        assert cluster.session is not None
        await asyncio.sleep(0.1 * i)  # (sent in order: the engine queues them as the gateway counted them)
        async with cluster.session.post(cluster.url + "/v1/chat/completions", json=chat(i)) as r:
            return r.status, await r.text()

    # Each prompt takes ~0.5 s to prefill: the second waits ~0.4 s and the third ~0.9 s before theirs
    # starts, past the limit; the gateway's own count of the engine's queue says so, and waits that long.
    answers = await asyncio.gather(*(one(i) for i in range(3)))
    assert [status for status, _ in answers] == [200] * 3
    assert all(text.endswith("data: [DONE]\n\n") for _, text in answers)
    assert cluster.gateway.fleet.engines["eu-west/e0"].breaker.state is BreakerState.CLOSED
