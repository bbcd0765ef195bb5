"""Requests decided at the same moment see each other's decisions: an agent's fan-out stays together.

The routing decision is committed when it is made (gateway.routing.router): the session's binding and the
prompt's blocks as "held soon" are in the view before the first request reaches its engine, so the next
request, decided a microsecond later, follows it instead of preferring the engine the first one left idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import orjson
import pytest
from redis.asyncio import Redis

from cache.redis_keys import RedisKeys
from tests.harness import MODEL, Cluster, ClusterFactory
from tests.redis_process import RedisProcess

# Prefill takes time, so that parallel requests really overlap inside the engines.
SLOW_PREFILL = {"prefill_s_per_token": 2e-5, "decode_s_per_token": 0.0005}


def prefix(tag: str, words: int = 300) -> str:
    return " ".join(f"{tag}-{i}" for i in range(words))


async def ask(
    cluster: Cluster, prompt: str, *, session: str | None, stream: bool, url: str | None = None
) -> tuple[str, int, int]:
    """(engine, prompt tokens, cached tokens) of one completion."""
    assert cluster.session is not None
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    headers = {"x-session-affinity": session} if session else {}
    async with cluster.session.post(
        (url or cluster.url) + "/v1/completions", json=body, headers=headers
    ) as r:
        assert r.status == 200, await r.text()
        engine = r.headers["x-kvgate-engine"]
        if not stream:
            usage = (await r.json())["usage"]
        else:
            usage = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    event = orjson.loads(line[6:])
                    usage = event.get("usage") or usage
            assert usage is not None
    return engine, usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


async def fan_out(
    cluster: Cluster, base: str, n: int, *, session: str | None, stream: bool
) -> list[tuple[str, int, int]]:
    return await asyncio.gather(
        *(ask(cluster, f"{base} call-{i} do {i}", session=session, stream=stream) for i in range(n))
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("redis", [False, True], ids=["embedded", "redis"])
async def test_parallel_first_requests_of_a_new_session_land_on_one_engine(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys, stream: bool, redis: bool
) -> None:
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix} if redis else {}
    cluster = await make_cluster({"eu-west": 4}, sim=SLOW_PREFILL, **shared)
    for n in (2, 4, 8, 16):
        for trial in range(3):
            session = f"agent-{uuid.uuid4().hex[:8]}"
            base = prefix(f"t{n}x{trial}")
            first = await fan_out(cluster, base, n, session=session, stream=stream)
            engines = {engine for engine, _, _ in first}
            assert len(engines) == 1, (n, trial, sorted(engines))
            # The next turn resends the conversation: every call of its fan-out finds it cached.
            second = await fan_out(cluster, base + " result ok next", n, session=session, stream=stream)
            assert {engine for engine, _, _ in second} == engines
            assert all(cached > 0 for _, _, cached in second), second


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_simultaneous_twin_prefixes_land_together_without_a_session(
    make_cluster: ClusterFactory, stream: bool
) -> None:
    cluster = await make_cluster({"eu-west": 4}, sim=SLOW_PREFILL)
    for trial in range(6):
        twins = await fan_out(cluster, prefix(f"twin{trial}"), 3, session=None, stream=stream)
        assert len({engine for engine, _, _ in twins}) == 1, (trial, twins)


async def test_a_claim_is_taken_back_when_the_engine_fails_before_taking_the_request(
    make_cluster: ClusterFactory,
) -> None:
    """The first choice refuses connections: the session ends bound to the engine that answered, and the
    refused engine holds no "held soon" prefix in the view."""
    cluster = await make_cluster({"eu-west": 2}, sim=SLOW_PREFILL)
    await cluster.wait_for(lambda: all(e.healthy for e in cluster.gateway.fleet))
    await cluster.stop_engine("eu-west/e0")
    gateway = cluster.gateway
    # Until its health check notices, the gateway still believes e0 healthy: make it the obvious choice.
    busy = gateway.fleet.engines["eu-west/e1"]
    queued = busy.prefill.add(10**6, time.monotonic())  # ~50 s of prefill at the default estimate
    assert queued is not None
    gateway.fleet.engines["eu-west/e0"].healthy = True
    try:
        engine, _, _ = await ask(cluster, prefix("refused"), session="s-refused", stream=False)
    finally:
        busy.prefill.settle(queued, time.monotonic())
    assert engine == "eu-west/e1"
    binding = gateway.state.sessions.get_now("default", "s-refused")
    assert binding is not None and binding.engine == "eu-west/e1"
    assert gateway.fleet.engines["eu-west/e0"].prefill.tokens == 0
    assert not gateway.state.index.held_soon_now("eu-west/e0")  # nothing "held soon" left there


async def test_a_client_that_leaves_while_its_sessions_claim_travels_leaves_no_load_or_binding(
    make_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A new session's request waits for its claim in Redis before it goes anywhere, its route already
    committed (its prompt counted as queued on the engine, the session bound). A client that leaves
    meanwhile must take all that back: else the engine's queue estimate never returns to 0 and the session
    stays bound where no request went."""
    server = RedisProcess(tmp_path)  # a Redis of the test's own, to freeze
    server.start()
    try:
        cluster = await make_cluster({"eu-west": 1}, redis_url=server.url)
        gateway = cluster.gateway
        engine = gateway.fleet.engines["eu-west/e0"]
        await cluster.wait_for(lambda: engine.healthy)
        assert server.process is not None
        # The claim gets no answer; it gives up after 0.25 s by default, which a loaded machine can spend
        # before the client below leaves (the request then goes on to the engine, and its binding rightly
        # stays): the test needs the client to leave while the claim still waits.
        gateway.state._read_timeout_s = 2.0
        server.process.send_signal(signal.SIGSTOP)
        try:
            request = asyncio.ensure_future(ask(cluster, prefix("gone"), session="s-gone", stream=False))
            await cluster.wait_for(lambda: bool(gateway.state.claims))
            assert engine.prefill.tokens > 0  # committed: queued there while the claim travels
            request.cancel()  # the client leaves
            with contextlib.suppress(asyncio.CancelledError):
                await request
            assert gateway.state.claims  # (it left while the claim waited)
            await cluster.wait_for(lambda: not gateway.state.claims, within_s=10)  # the claim gave up
        finally:
            server.process.send_signal(signal.SIGCONT)
        await cluster.wait_for(lambda: engine.inflight == 0)
        assert engine.prefill.tokens == 0, "the engine's queue estimate kept a prompt that never went there"
        assert engine.queued_prefill_tokens(time.monotonic(), 0.0) == 0
        # The rest is taken back by a callback of the claim's answer, which runs one turn of the event loop
        # after the claim leaves ``claims``: on a busy machine the test could look in between.
        await cluster.wait_for(
            lambda: (
                gateway.state.sessions.get_now("default", "s-gone") is None
                and not gateway.state.index.held_soon_now("eu-west/e0")
            )
        )
    finally:
        server.stop()


async def test_two_gateways_on_one_redis_agree_on_a_session_claimed_in_parallel(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    """Both gateways get half of a new session's fan-out at once: the newest claim wins everywhere, and the
    next turn, through either gateway, goes to that one engine."""
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix}
    cluster = await make_cluster({"eu-west": 4}, sim=SLOW_PREFILL, **shared)
    _, second_url = await cluster.add_gateway("eu-west", **shared)
    session, base = "shared-agent", prefix("two-gateways")
    first_url = cluster.url

    calls = [
        ask(
            cluster, f"{base} call-{i}", session=session, stream=False, url=first_url if i % 2 else second_url
        )
        for i in range(4)
    ]
    await asyncio.gather(*calls)
    client = Redis.from_url(redis_url)
    try:
        engines: set[str] = set()
        stored: list[Any] = []
        for _ in range(100):
            raw = await client.get(redis_keys.session("default", session))
            views = [g.state.sessions.get_now("default", session) for g, _ in cluster.gateways]
            engines = {b.engine for b in views if b is not None}
            stored = msgpack.unpackb(raw) if raw is not None else []
            if len(engines) == 1 and stored and stored[1] in engines:
                break
            await asyncio.sleep(0.05)
        assert len(engines) == 1 and stored and stored[1] in engines, (engines, stored)
    finally:
        await client.aclose()
    # The next turn, through either gateway, goes to that engine.
    (engine,) = engines
    for url in (first_url, second_url):
        answered, _, cached = await ask(
            cluster, f"{base} call-0 next", session=session, stream=False, url=url
        )
        assert answered == engine and cached > 0


def lean_to(gateway: Any, favourite: str, by: int) -> None:
    """Make ``favourite`` the least loaded engine in ``gateway``'s view (``by`` < 0 undoes it)."""
    for engine in gateway.fleet:
        if engine.id != favourite:
            engine.inflight += by


async def test_a_new_session_claimed_through_two_gateways_at_once_goes_to_one_engine(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys
) -> None:
    """Each gateway's view prefers another engine, and both get the first request of one new session at the
    same moment: the first claim in Redis wins, the other gateway follows it before sending anything."""
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix, "routing": {"policy": "session"}}
    cluster = await make_cluster({"eu-west": 4}, sim=SLOW_PREFILL, **shared)
    second, second_url = await cluster.add_gateway("eu-west", **shared)
    first = cluster.gateway
    await cluster.wait_for(lambda: all(e.healthy for g in (first, second) for e in g.fleet))
    lean_to(first, "eu-west/e0", 5)
    lean_to(second, "eu-west/e1", 5)
    try:
        for trial in range(4):
            session, base = f"race-{trial}-{uuid.uuid4().hex[:6]}", prefix(f"race{trial}")
            answers = await asyncio.gather(
                ask(cluster, f"{base} a", session=session, stream=False),
                ask(cluster, f"{base} b", session=session, stream=False, url=second_url),
            )
            assert len({engine for engine, _, _ in answers}) == 1, (trial, answers)
    finally:
        lean_to(first, "eu-west/e0", -5)
        lean_to(second, "eu-west/e1", -5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_the_next_turn_through_another_gateway_follows_the_first_at_once(
    make_cluster: ClusterFactory, redis_url: str, redis_keys: RedisKeys, stream: bool
) -> None:
    """Turn 1 through one gateway, turn 2 through another as soon as turn 1 is answered (well within the
    50 ms a client takes to send its next turn): turn 2 goes to turn 1's engine, as a session."""
    shared = {"redis_url": redis_url, "redis_prefix": redis_keys.prefix, "routing": {"policy": "session"}}
    cluster = await make_cluster({"eu-west": 4}, sim=SLOW_PREFILL, **shared)
    second, second_url = await cluster.add_gateway("eu-west", **shared)
    first = cluster.gateway
    await cluster.wait_for(lambda: all(e.healthy for g in (first, second) for e in g.fleet))
    lean_to(first, "eu-west/e0", 5)
    lean_to(second, "eu-west/e1", 5)  # left alone, the second gateway would choose another engine
    try:
        for trial in range(5):
            session, base = f"turns-{trial}-{uuid.uuid4().hex[:6]}", prefix(f"turns{trial}")
            turn1, _, _ = await ask(cluster, base, session=session, stream=stream)
            assert cluster.session is not None
            body = {"model": MODEL, "prompt": base + " ok next", "max_tokens": 2}
            async with cluster.session.post(
                second_url + "/v1/completions", json=body, headers={"x-session-affinity": session}
            ) as r:
                assert r.status == 200, await r.text()
                assert (r.headers["x-kvgate-engine"], r.headers["x-kvgate-route"]) == (turn1, "session")
    finally:
        lean_to(first, "eu-west/e0", -5)
        lean_to(second, "eu-west/e1", -5)
