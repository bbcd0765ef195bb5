"""The ZMQ KV event consumer against a vLLM-protocol publisher over real sockets, into a real SharedState:
after every scenario (stores, tail-first evictions, a clear, a missed batch, a restart, a gap replay cannot
fill, both connection directions, the positional encoding, two data-parallel ranks) the residency index
must say exactly what the engine's cache holds, in kvgate's hashes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from cache.cancelling import cancel_and_wait
from cache.hashing import block_hashes, namespace_seed
from gateway.state.shared_state import SharedState
from gateway.state.zmq_drops import GRACE_S
from gateway.state.zmq_endpoints import gateway_binds, rank_endpoint, replay_address
from gateway.state.zmq_events import ZmqKvEventConsumer
from region_map.config import EngineConfig, EngineKind
from region_map.fleet import EngineState
from tests import vllm_publisher as vp

BS = 16
MODEL = "m"
EID = "r/v0"


def engine_state(
    endpoint: str,
    replay: str | None,
    *,
    dp: int = 1,
    topic: str = "",
    model: str | None = MODEL,
    kind: EngineKind = EngineKind.VLLM,
) -> EngineState:
    config = EngineConfig.model_validate(
        {
            "name": "v0",
            "url": "http://127.0.0.1:8000",
            "kind": kind,
            "model": model,
            "block_size": BS,
            "kv_events_endpoint": endpoint,
            "kv_events_replay_endpoint": replay,
            "kv_events_topic": topic,
            "data_parallel_size": dp,
        }
    )
    return EngineState(id=EID, region="r", config=config)


def kv(tokens: list[int], *, salt: str = "", name: str = MODEL) -> list[int]:
    return block_hashes(tokens, BS, namespace_seed(name, salt))


def prompt(n_blocks: int, start: int) -> list[int]:
    return list(range(start, start + n_blocks * BS))


class FakeVllm:
    """A vLLM prefix cache as its events describe it: per prompt a chain of blocks with vLLM-style opaque
    ids; a prefill announces the blocks not cached yet, chained to the last cached one; eviction removes
    a prompt's blocks tail first, one event per block."""

    def __init__(self, pub: vp.VllmPublisher, none_hash: bytes = vp.NONE_HASH) -> None:
        self.pub = pub
        self.none_hash = none_hash
        self.cached: set[int] = set()

    def ids(self, tokens: list[int], salt: str | None = None) -> list[int]:
        return vp.vllm_block_hashes(tokens, BS, cache_salt=salt, none_hash=self.none_hash).ids

    def prefill(self, tokens: list[int], *, salt: str | None = None, drop: bool = False) -> int:
        ids = self.ids(tokens, salt)
        have = 0
        while have < len(ids) and ids[have] in self.cached:
            have += 1
        new = ids[have:]
        self.cached.update(new)
        extra = [vp.extra_keys_for(i * BS, cache_salt=salt) for i in range(have, len(ids))]
        event = vp.BlockStored(
            new,
            ids[have - 1] if have else None,
            tokens[have * BS : len(ids) * BS],
            BS,
            extra_keys=extra,
        )
        return self.pub.publish([event] if new else [], drop=drop)

    def evict(self, tokens: list[int], keep: int, *, salt: str | None = None, drop: bool = False) -> int:
        ids = [i for i in self.ids(tokens, salt)[keep:] if i in self.cached]
        self.cached.difference_update(ids)
        return self.pub.publish([vp.BlockRemoved([i]) for i in reversed(ids)], drop=drop)

    def clear(self) -> int:
        self.cached.clear()
        return self.pub.publish([vp.AllBlocksCleared()])


async def until(condition: Callable[[], bool], within: float = 3.0, what: str = "") -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await asyncio.sleep(0.002)


def holds(state: SharedState, hashes: list[int], n: int) -> Callable[[], bool]:
    """Whether the index says the engine holds exactly the first ``n`` blocks of ``hashes``."""
    return lambda: state.lookup(hashes) == ({EID: n} if n else {})


@contextlib.asynccontextmanager
async def following(engine: EngineState, state: SharedState, **kw: Any) -> AsyncIterator[ZmqKvEventConsumer]:
    kw.setdefault("replay_timeout_s", 0.5)
    kw.setdefault("probe_interval_s", 5.0)
    consumer = ZmqKvEventConsumer(engine, state, **kw)
    task = asyncio.create_task(consumer.run())
    try:
        if engine.model is not None:
            await asyncio.wait_for(consumer.ready.wait(), 3)
        yield consumer
    finally:
        await cancel_and_wait(task)
        assert consumer.errors == 0


@contextlib.asynccontextmanager
async def holding(
    engine: FakeVllm, engine_: EngineState, state: SharedState, a: list[int], **kw: Any
) -> AsyncIterator[ZmqKvEventConsumer]:
    """Following with a 1 MiB message limit, subscribed, and ``a`` prefilled and held: where the tests of
    messages over the limit start."""
    async with following(engine_, state, max_message_bytes=1 << 20, **kw) as consumer:
        await subscribed(engine.pub, consumer)
        engine.prefill(a)
        await until(holds(state, kv(a), 2))
        yield consumer


async def subscribed(pub: vp.VllmPublisher, consumer: ZmqKvEventConsumer, rank: int = 0) -> None:
    """Publish empty batches until one arrives live: ZMQ's subscription reaches a PUB socket a moment after
    the subscriber connects (the "slow joiner"), and what is sent before is lost to it."""
    for _ in range(200):
        seq = pub.publish([])
        deadline = time.monotonic() + 0.02
        while time.monotonic() < deadline:
            last = consumer.last_seq(rank)
            if last is not None and last >= seq:
                return
            await asyncio.sleep(0.001)
    raise AssertionError("the subscription never became live")


@pytest.fixture
def ports() -> int:
    return vp.free_tcp_ports(4)


@pytest.fixture
def state() -> SharedState:
    return SharedState(gateway_id="t")


def test_endpoint_rules() -> None:
    assert rank_endpoint("tcp://h:5557", 0) == "tcp://h:5557"
    assert rank_endpoint("tcp://h:5557", 3) == "tcp://h:5560"
    assert rank_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    with pytest.raises(ValueError, match="tcp://"):
        rank_endpoint("ipc://engine.sock", 1)
    assert (
        gateway_binds("tcp://*:5557") and gateway_binds("tcp://0.0.0.0:1") and gateway_binds("tcp://[::]:1")
    )
    assert not gateway_binds("tcp://10.0.0.5:5557") and not gateway_binds("ipc://engine.sock")
    assert replay_address("tcp://*:5558", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5558"
    assert replay_address("tcp://*:5558", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5558"
    assert replay_address("tcp://e:5558", "http://10.1.2.3:8000") == "tcp://e:5558"


async def test_stores_evictions_and_clear_follow_the_engine(ports: int, state: SharedState) -> None:
    assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")  # as in the gateway
    a, b, salted = prompt(6, 0), prompt(3, 5000), prompt(2, 0)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        engine.prefill(a[: 2 * BS])  # before the gateway listens: learnt from the replay
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await until(holds(state, kv(a), 2), what="history from the replay")
            await subscribed(pub, c)
            engine.prefill(a)  # chunked prefill: the rest of the prompt, chained to block 2
            engine.prefill(b)
            engine.prefill(salted, salt="tenant-a")
            await until(holds(state, kv(a), 6), what="the whole prompt")
            await until(holds(state, kv(b), 3))
            await until(holds(state, kv(salted, salt="tenant-a"), 2))
            assert state.lookup(kv(salted)) == {EID: 2}  # the unsalted blocks of a: another namespace
            engine.evict(a, keep=4)  # tail first
            await until(holds(state, kv(a), 4), what="eviction")
            engine.evict(b, keep=0)
            await until(holds(state, kv(b), 0))
            engine.clear()
            await until(holds(state, kv(a), 0), what="clear")
            assert state.lookup(kv(salted, salt="tenant-a")) == {}
            engine.prefill(a)  # the same ids again after a clear
            await until(holds(state, kv(a), 6))
            assert c.resyncs == 1 and c.gaps == 0 and c.restarts == 0 and c.unknown_parent_blocks == 0


async def test_same_block_announced_twice_leaves_with_its_last_copy(ports: int, state: SharedState) -> None:
    p = prompt(2, 0)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        ids = vp.vllm_block_hashes(p, BS).ids
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await subscribed(pub, c)
            # Two requests computed the same prompt in one step: two physical copies, each evicted alone.
            pub.publish([vp.BlockStored(ids, None, p, BS), vp.BlockStored(ids, None, p, BS)])
            await until(holds(state, kv(p), 2))
            pub.publish([vp.BlockRemoved([ids[1]]), vp.BlockRemoved([ids[0]])])
            seq = pub.publish([])
            await until(lambda: c.last_seq() == seq)
            assert state.lookup(kv(p)) == {EID: 2}
            pub.publish([vp.BlockRemoved([ids[1]]), vp.BlockRemoved([ids[0]])])
            await until(holds(state, kv(p), 0))


async def test_a_missed_batch_is_replayed(ports: int, state: SharedState) -> None:
    a, b = prompt(4, 0), prompt(2, 9000)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await subscribed(pub, c)
            replays = c.replays
            engine.prefill(a[: 2 * BS], drop=True)  # lost on the way: only the replay buffer has it
            engine.prefill(a)  # children of the lost blocks: the gap shows before they are applied
            await until(holds(state, kv(a), 4))
            assert c.gaps == 1 and c.replays == replays + 1
            engine.evict(a, keep=3, drop=True)  # a lost eviction must be replayed too
            engine.prefill(b)
            await until(holds(state, kv(b), 2))
            await until(holds(state, kv(a), 3))
            assert c.gaps == 2 and c.replays == replays + 2
            assert c.resyncs == 1 and c.unknown_parent_blocks == 0


async def test_a_missed_last_batch_is_found_by_the_idle_probe(ports: int, state: SharedState) -> None:
    a = prompt(3, 0)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with following(engine_, state, probe_interval_s=0.05) as c:
            await subscribed(pub, c)
            engine.prefill(a, drop=True)  # nothing follows it: no gap will ever show
            await until(holds(state, kv(a), 3), what="the probe's replay")
            assert c.gaps == 0


async def test_engine_restart_resets_its_blocks(ports: int, state: SharedState) -> None:
    a, b = prompt(4, 0), prompt(2, 7000)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 4))
            pub.restart()  # seq 0 again, an empty cache; a new PYTHONHASHSEED gives other ids
            engine = FakeVllm(pub, none_hash=b"another-seed")
            engine.prefill(b)
            await until(holds(state, kv(b), 2), what="the new incarnation's blocks")
            await until(holds(state, kv(a), 0), what="the old incarnation forgotten")
            assert c.restarts == 1 and c.resyncs == 2


async def test_restart_that_reaches_our_seq_is_caught_after_a_disconnect(
    ports: int, state: SharedState
) -> None:
    """The engine restarts while the gateway is cut off, and publishes exactly as many batches as the gateway
    had seen: the next live batch looks like the next one. The dropped connection makes the consumer check
    its last batch against the engine's replay buffer first."""
    a, b = prompt(4, 0), prompt(2, 7000)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 4))
            last = c.last_seq()
            assert last is not None
            pub.restart(reopen=True)
            await until(lambda: c.disconnects >= 1, what="the disconnect")
            await asyncio.to_thread(pub.wait_for_subscriber)
            engine = FakeVllm(pub, none_hash=b"another-seed")
            for _ in range(last + 1):
                pub.publish([], drop=True)
            engine.prefill(b)  # seq last + 1
            await until(holds(state, kv(b), 2))
            await until(holds(state, kv(a), 0), what="the old incarnation forgotten")
            assert c.restarts == 1


async def test_gap_without_replay_resyncs_to_empty(ports: int, state: SharedState) -> None:
    a, b, d = prompt(3, 0), prompt(2, 3000), prompt(2, 6000)
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", None), state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 3))
            engine.evict(a, keep=1, drop=True)  # lost, and nobody can replay it: a is no longer known
            engine.prefill(b, drop=True)
            engine.prefill(d)
            await until(holds(state, kv(d), 2))
            assert state.lookup(kv(a)) == {} and state.lookup(kv(b)) == {}  # under-predicting, not wrong
            assert c.gaps == 1 and c.resyncs == 2
            engine.prefill(a)  # the engine re-announces a's missing blocks only: their parent is unknown
            seq = pub.publish([])
            await until(lambda: c.last_seq() == seq)
            assert state.lookup(kv(a)) == {} and c.unknown_parent_blocks == 2


async def test_gap_the_replay_buffer_no_longer_holds_resyncs(ports: int, state: SharedState) -> None:
    a, b, d = prompt(3, 0), prompt(2, 3000), prompt(2, 6000)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}"), state
        ) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 3))
            engine.evict(a, keep=1, drop=True)  # missed, and about to leave the engine's buffer
            kept = engine.prefill(b, drop=True)
            pub.forget_before(kept)
            engine.prefill(d)
            await until(holds(state, kv(d), 2))
            await until(holds(state, kv(b), 2), what="what the buffer still had")
            assert state.lookup(kv(a)) == {}  # its eviction is lost: forgotten rather than guessed
            assert c.gaps == 1 and c.resyncs == 2


async def test_seq_back_without_replay_resyncs_then_applies(ports: int, state: SharedState) -> None:
    a, b = prompt(3, 0), prompt(2, 3000)
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", None), state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 3))
            pub.restart()
            FakeVllm(pub, none_hash=b"other").prefill(b)  # seq 0
            await until(holds(state, kv(b), 2))
            assert state.lookup(kv(a)) == {} and c.restarts == 1


async def test_engine_connects_to_the_gateway(ports: int, state: SharedState) -> None:
    """vLLM's PUB connects when its endpoint names a host: the gateway binds (``tcp://*:port``). The replay
    ROUTER is always the engine's, written here in the engine's own notation."""
    a = prompt(3, 0)
    engine_ = engine_state(f"tcp://*:{ports}", f"tcp://*:{ports + 1}")
    # Started before the engine: its replay socket does not answer yet, so the idle probe asks again.
    async with following(engine_, state, replay_timeout_s=0.02, probe_interval_s=0.02) as c:
        with vp.VllmPublisher(f"tcp://127.0.0.1:{ports}", f"tcp://*:{ports + 1}") as pub:
            engine = FakeVllm(pub)
            engine.prefill(a[:BS])
            await until(holds(state, kv(a), 1), what="the replay")
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 3))


async def test_positional_encoding_and_replay_without_topic(ports: int, state: SharedState) -> None:
    a = prompt(4, 0)
    pub = vp.VllmPublisher(
        f"tcp://*:{ports}",
        f"tcp://*:{ports + 1}",
        encoding="positional",
        replay_topic_frame=False,
        topic="kv",
    )
    with pub:
        engine = FakeVllm(pub)
        engine.prefill(a[: 2 * BS])
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}", topic="kv")
        async with following(engine_, state) as c:
            await until(holds(state, kv(a), 2))
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 4))
            engine.evict(a, keep=1)
            await until(holds(state, kv(a), 1))


async def test_sglang_epoch_change_is_a_restart(ports: int, state: SharedState) -> None:
    """SGLang with snapshots on puts its publisher's lifetime id in the topic; a new one is a restart even
    when its seq happens to continue ours."""
    a, b = prompt(2, 0), prompt(2, 4000)
    with vp.VllmPublisher(
        f"tcp://*:{ports}", f"tcp://*:{ports + 1}", topic="kv\x00sgl-kv-epoch=one", encoding="positional"
    ) as pub:
        engine = FakeVllm(pub)
        engine_ = engine_state(
            f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}", topic="kv", kind=EngineKind.SGLANG
        )
        async with following(engine_, state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))
            seq = pub.next_seq
            pub.restart()
            pub.topic = b"kv\x00sgl-kv-epoch=two"
            for _ in range(seq):
                pub.publish([], drop=True)
            FakeVllm(pub, none_hash=b"x").prefill(b)  # seq continues ours exactly
            await until(holds(state, kv(b), 2))
            await until(holds(state, kv(a), 0))
            assert c.restarts == 1


async def test_two_data_parallel_ranks(ports: int, state: SharedState) -> None:
    a, b = prompt(3, 0), prompt(2, 8000)
    engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 2}", dp=2)
    with (
        vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 2}", data_parallel_rank=0) as pub0,
        vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 2}", data_parallel_rank=1) as pub1,
    ):
        assert pub1.endpoint == f"tcp://*:{ports + 1}" and pub1.replay_endpoint == f"tcp://*:{ports + 3}"
        rank0, rank1 = FakeVllm(pub0), FakeVllm(pub1, none_hash=b"rank-1 seed")
        async with following(engine_, state) as c:
            await subscribed(pub0, c, 0)
            await subscribed(pub1, c, 1)
            for _ in range(5):
                pub1.publish([])  # rank 1's seq runs ahead of rank 0's: the ranks' seqs are their own
            rank0.prefill(a)
            rank1.prefill(a[: 2 * BS])
            rank1.prefill(b)
            await until(holds(state, kv(a), 3))
            await until(holds(state, kv(b), 2))
            rank0.evict(a, keep=0)  # rank 1 still holds the first two blocks
            await until(holds(state, kv(a), 2))
            rank1.clear()  # a rank's clear is not the engine's
            await until(holds(state, kv(a), 0))
            await until(holds(state, kv(b), 0))
            rank0.prefill(b)
            rank1.prefill(a)
            await until(holds(state, kv(b), 2))
            await until(holds(state, kv(a), 3))
            pub1.restart()  # rank 1 restarts: rank 0's blocks stay
            FakeVllm(pub1, none_hash=b"new").prefill(prompt(1, 20000))
            await until(holds(state, kv(a), 0))
            await until(lambda: c.last_seq(1) == 0, what="rank 1's new history")
            assert state.lookup(kv(b)) == {EID: 2} and c.restarts == 1


async def test_unreadable_batch_counts_as_lost(ports: int, state: SharedState) -> None:
    a, b = prompt(2, 0), prompt(2, 500)
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", None), state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))
            pub.publish([], payload=b"\x93\xcb")  # truncated msgpack
            engine.prefill(b)
            await until(holds(state, kv(b), 2))
            assert state.lookup(kv(a)) == {} and c.decode_errors == 1 and c.resyncs == 2


async def test_an_event_type_it_does_not_know_is_skipped_and_the_rest_of_its_batch_applies(
    ports: int, state: SharedState
) -> None:
    # A newer vLLM adding an event type must not cost the rank its residency at every batch carrying one.
    a, b = prompt(2, 0), prompt(3, 500)
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", None), state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))
            ids = engine.ids(b)
            engine.cached.update(ids)
            stored = vp.encode_event(vp.BlockStored(ids, None, b, BS, extra_keys=[None] * 3))
            assert isinstance(stored, dict)
            pub.publish(
                [
                    {"type": "BlockPinned", "block_hashes": ids[:1], "medium": "GPU"},
                    {**stored, "session_id": "s1", "kv_cache_spec_kind": "full"},  # fields it does not know
                    ["BlockTiered", ids[:1], "CPU"],
                ]
            )
            await until(holds(state, kv(b), 3), what="the stored blocks beside the unknown events")
            engine.evict(a, keep=1)
            await until(holds(state, kv(a), 1))
            assert c.unknown_events == 2 and c.decode_errors == 0 and c.resyncs == 1


async def test_a_batch_with_a_field_after_the_rank_applies(ports: int, state: SharedState) -> None:
    # A newer vLLM appending a field to its EventBatch made every batch unreadable: the rank was forgotten.
    a, b = prompt(2, 0), prompt(2, 500)
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", None), state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))
            ids = engine.ids(b)
            event = vp.encode_event(vp.BlockStored(ids, None, b, BS, extra_keys=[None, None]))
            pub.publish([], payload=msgpack.packb([time.time(), [event], 0, {"future": True}]))
            await until(holds(state, kv(b), 2), what="the batch with a field after the rank")
            assert state.lookup(kv(a)) == {EID: 2} and c.decode_errors == 0 and c.resyncs == 1


async def test_a_batch_with_an_array_as_a_map_key_counts_as_lost_and_following_goes_on(
    ports: int, state: SharedState
) -> None:
    # Valid msgpack that no Python dict can hold: ``[ts, [{[1]: 1}], nil]``. It must read as one unreadable
    # batch, not as an error that leaves the rank stuck replaying it (the replay hands it back every time).
    crafted = b"\x93\xcb" + struct.pack(">d", 1.0) + b"\x91\x81\x91\x01\x01\xc0"
    a, b = prompt(2, 0), prompt(2, 500)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with following(engine_, state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))
            pub.publish([], payload=crafted)
            engine.prefill(b)
            await until(holds(state, kv(b), 2), what="the batch after the crafted one")
            assert state.lookup(kv(a)) == {} and c.decode_errors == 1 and c.errors == 0


async def test_waits_for_the_model_and_stops_cleanly(ports: int, state: SharedState) -> None:
    a = prompt(2, 0)
    engine_ = engine_state(f"tcp://*:{ports}", None, model=None)
    async with following(engine_, state, model_poll_s=0.01) as c:
        await asyncio.sleep(0.05)
        assert c.chain is None and not c.ready.is_set()  # no namespace yet: nothing bound, nothing read
        engine_.reported_model = MODEL
        await asyncio.wait_for(c.ready.wait(), 3)
        with vp.VllmPublisher(f"tcp://127.0.0.1:{ports}") as pub:
            await subscribed(pub, c)
            FakeVllm(pub).prefill(a)
            await until(holds(state, kv(a), 2))
    # Cancelled: its sockets are closed, so another consumer can bind the same port at once.
    async with following(engine_state(f"tcp://*:{ports}", None), SharedState(gateway_id="t2")) as again:
        assert again.ready.is_set()


async def test_a_new_model_starts_over_in_its_namespace(ports: int, state: SharedState) -> None:
    a = prompt(3, 0)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}", model=None)
        engine_.reported_model = MODEL
        async with following(engine_, state) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 3))
            engine_.reported_model = "m2"  # the engine was redeployed with another model (same history)
            pub.publish([])
            await until(
                lambda: state.lookup(kv(a, name="m2")) == {EID: 3}, what="the replay in m2's namespace"
            )
            assert (
                state.lookup(kv(a)) == {} and c.resyncs == 2 and c.chain is not None and c.chain.model == "m2"
            )


# -- frames recorded from a real vLLM 0.32.0 ------------------------------------------------------------

RECORDING = Path(__file__).parent.parent / "data" / "vllm-0.32.0-kv-events"


def recording() -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if not (RECORDING / "frames.jsonl").exists():
        pytest.skip("no recording of vLLM 0.32.0 KV events here")
    lines = (RECORDING / "frames.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], json.loads((RECORDING / "requests.json").read_text())


def tiny(tokens: list[int], salt: str = "") -> list[int]:
    return block_hashes(tokens, 32, namespace_seed("tiny", salt))


def recorded_engine(endpoint: str, replay: str | None) -> EngineState:
    config = EngineConfig.model_validate(
        {
            "name": "v0",
            "url": "http://127.0.0.1:8000",
            "kind": "vllm",
            "model": "tiny",
            "block_size": 32,
            "kv_events_endpoint": endpoint,
            "kv_events_replay_endpoint": replay,
            "kv_events_topic": "kv-events",
        }
    )
    return EngineState(id=EID, region="r", config=config)


async def test_recorded_vllm_0_32_live_frames(ports: int, state: SharedState) -> None:
    """The live frames a real vLLM 0.32.0 sent, re-sent byte for byte in seq order."""
    frames, requests = recording()
    long_ids = requests["long_prompt_token_ids"]
    live = sorted((r for r in frames if r["socket"] == "sub"), key=lambda r: r["seq"])
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}", topic="kv-events") as pub:
        engine = recorded_engine(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with following(engine, state) as c:
            await subscribed(pub, c)
            pub.restart()  # the recording starts at seq 0: what the consumer saw so far was another life
            for record in live:
                topic, seq, payload = (bytes.fromhex(f) for f in record["frames"])
                assert topic == b"kv-events" and int.from_bytes(seq, "big") == record["seq"]
                pub.publish([], payload=payload)
                if record["seq"] == 10:  # after the salted repeat (step D)
                    await until(lambda: c.last_seq() == 10)
                    assert state.lookup(tiny(long_ids)) == {EID: 15}
                    assert state.lookup(tiny(long_ids, "tenant-a")) == {EID: 15}
            await until(lambda: c.last_seq() == live[-1]["seq"])
            # After the reset only the 500-token prompt is back, unsalted.
            assert state.lookup(tiny(long_ids)) == {EID: 15}
            assert state.lookup(tiny(long_ids, "tenant-a")) == {}
            assert c.restarts == 1 and c.unknown_parent_blocks == 0


async def test_recorded_vllm_0_32_replay_answer(ports: int, state: SharedState) -> None:
    """A real vLLM 0.32.0 replay answer, served byte for byte by a ROUTER: batches 28..34 (evictions of
    blocks the gateway never heard of, a prefix-cache reset, the long prompt again), then the end marker."""
    frames, requests = recording()
    answer = [[bytes.fromhex(f) for f in r["frames"]] for r in frames if r["step"] == "R-replay"]
    assert answer[-1] == [b"", b"", b"\xff" * 8, b""]
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{ports + 1}")
    starts: list[int] = []

    async def serve() -> None:
        while True:
            client, _, start = await router.recv_multipart()
            starts.append(int.from_bytes(start, "big"))
            for message in answer:
                await router.send_multipart([client, *message])

    server = asyncio.create_task(serve())
    try:
        engine = recorded_engine(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with following(engine, state) as c:
            assert starts == [0] and c.last_seq() == 34
            assert state.lookup(tiny(requests["long_prompt_token_ids"])) == {EID: 15}
            assert c.unknown_parent_blocks == 0 and c.batches == 7
    finally:
        await cancel_and_wait(server)
        router.close(linger=0)
        context.term()


async def test_a_replay_socket_that_never_answers_is_a_warning_once_not_a_silent_guess(
    ports: int, state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    a = prompt(2, 0)
    # The replay endpoint names a port nothing listens on (a typo, a firewalled port).
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub, caplog.at_level(logging.INFO, "kvgate.zmq_events"):
        engine = FakeVllm(pub)
        silent = f"tcp://127.0.0.1:{ports + 3}"
        async with following(
            engine_state(f"tcp://127.0.0.1:{ports}", silent), state, probe_interval_s=0.2
        ) as c:
            await subscribed(pub, c)
            engine.prefill(a)
            await until(holds(state, kv(a), 2))  # live events still count
            await asyncio.sleep(0.8)  # several idle probes, each unanswered
        warnings = [r for r in caplog.records if "replay socket does not answer" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
        assert "kv_events_replay_endpoint" in warnings[0].getMessage()


async def test_a_replay_socket_known_to_be_silent_holds_no_live_batch_after_a_disconnect(
    ports: int, state: SharedState
) -> None:
    """After the publisher's connection drops, the next live batch is checked against the replay buffer
    first. With a replay socket that never answers, every later batch asked it again and waited for its
    timeout (one replay request per batch): the live stream fell further behind with each batch."""
    with vp.VllmPublisher(f"tcp://*:{ports}") as pub:
        engine = FakeVllm(pub)
        silent = f"tcp://127.0.0.1:{ports + 3}"
        async with following(engine_state(f"tcp://127.0.0.1:{ports}", silent), state) as c:
            await subscribed(pub, c)
            pub.reconnect()
            await until(lambda: c.disconnects >= 1, what="the disconnect")
            await asyncio.to_thread(pub.wait_for_subscriber)
            asked = c.replays
            prompts = [prompt(1, 1000 * i) for i in range(1, 5)]
            for tokens in prompts:
                engine.prefill(tokens)
            for tokens in prompts:
                await until(holds(state, kv(tokens), 1), within=5.0)
            assert c.replays - asked <= 1  # (an idle probe may ask it once meanwhile)
            # Nor does each gap wait for it: the rank's blocks are forgotten at once, as without a replay.
            asked = c.replays
            for i in range(3):
                engine.prefill(prompt(1, 9000 + i), drop=True)  # lost on the way
                engine.prefill(tokens := prompt(1, 9500 + i))
                await until(holds(state, kv(tokens), 1), within=5.0)
            assert c.replays - asked <= 1 and c.gaps >= 3


async def test_an_endpoint_that_never_speaks_while_blocks_are_sent_is_a_warning_once(
    ports: int, state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    # Nothing publishes on the configured endpoint (a wrong port, or an engine started without events).
    engine = engine_state(f"tcp://127.0.0.1:{ports}", None)
    with caplog.at_level(logging.INFO, "kvgate.zmq_events"):
        async with following(engine, state, probe_interval_s=0.1) as c:
            await asyncio.sleep(0.4)
            assert not [
                r for r in caplog.records if "no KV event has arrived" in r.getMessage()
            ]  # nothing sent
            engine.awaited_blocks = 40  # what the gateway's dispatches note for an event engine
            await until(lambda: any("no KV event has arrived" in r.getMessage() for r in caplog.records))
            await asyncio.sleep(0.4)
            assert c.batches == 0
    said = [r for r in caplog.records if "no KV event has arrived" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and f":{ports}" in said[0].getMessage()


async def test_the_reconnect_backoff_starts_over_after_a_connection_that_worked(
    ports: int, state: SharedState, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pause before reopening a rank's socket doubled at each failure and never came back down: once an
    # engine had been away long enough, every later failure, however rare, cost the pause at its maximum.
    attempts: list[float] = []
    failed_at: list[float] = []
    fail = False
    follow_once, on_live = ZmqKvEventConsumer._follow_once, ZmqKvEventConsumer._on_live

    async def counted(self: ZmqKvEventConsumer, *args: Any) -> None:
        attempts.append(time.monotonic())
        await follow_once(self, *args)

    async def failing(self: ZmqKvEventConsumer, *args: Any) -> None:
        nonlocal fail
        if fail:
            fail = False
            failed_at.append(time.monotonic())
            raise OSError("connection reset")  # the socket fails after batches were heard on it
        await on_live(self, *args)

    monkeypatch.setattr(ZmqKvEventConsumer, "_follow_once", counted)
    monkeypatch.setattr(ZmqKvEventConsumer, "_on_live", failing)
    blocker = socket.socket()  # the port the gateway binds is taken: every attempt fails, the pause grows
    blocker.bind(("0.0.0.0", ports))
    blocker.listen()
    engine = engine_state(f"tcp://*:{ports}", None)
    async with following(engine, state, backoff_s=0.01, max_backoff_s=1.0) as c:
        await until(lambda: len(attempts) >= 9, 5, "the pause at its maximum")  # 0.01, 0.02, ... 0.64, 1.0
        blocker.close()
        await until(lambda: len(attempts) >= 10, 3, "the port bound")
        with vp.VllmPublisher(f"tcp://127.0.0.1:{ports}") as pub:
            await subscribed(pub, c)
            fail = True
            await until(lambda: pub.publish([]) >= 0 and bool(failed_at), 3, "the failure")
            await until(lambda: len(attempts) >= 11, 3, "the next attempt")
    assert attempts[-1] - failed_at[0] < 0.4  # the first pause again (0.01 s), not the maximum (1 s)


OVER = 2 << 20  # a payload over the 1 MiB limit the tests below set (the smallest the configuration takes)


async def test_a_message_over_the_size_limit_is_not_read_and_later_events_still_apply(
    ports: int, state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    # libzmq drops a connection whose peer sent more than MAXMSGSIZE and, on a socket that connected, never
    # reconnects: the follower must notice, reopen its socket and go on. The replay buffer holds the large
    # message too, so the catch-up replay after the reopen drops as well: it must fail at once, not after its
    # (here 30 s) timeout.
    a, b = prompt(2, 0), prompt(2, 500)
    with (
        vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub,
        caplog.at_level(logging.WARNING, "kvgate.zmq_events"),
    ):
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with holding(engine, engine_, state, a, replay_timeout_s=30) as c:
            pub.publish([], payload=b"\x00" * OVER)
            await until(lambda: c.oversized_messages >= 1, 3, "the dropped connection")
            await subscribed(pub, c)  # the socket was reopened
            engine.prefill(b)
            await until(holds(state, kv(b), 2), 3, "a batch after the large one")
            await until(lambda: c.oversized_messages >= 2, 3, "the replay's drop")  # (the live one's first)
            assert c.decode_errors == 0
        said = [r for r in caplog.records if "kv_event_max_message_bytes" in r.getMessage()]
        assert len(said) == 1  # not one per drop


async def test_a_replayed_message_over_the_size_limit_is_not_read(ports: int, state: SharedState) -> None:
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        pub.publish([], payload=b"\x00" * OVER)  # in the replay buffer before the gateway follows
        FakeVllm(pub).prefill(prompt(2, 0))
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        # (following() waits 3 s for the first replay: a request on a dropped socket fails at once.)
        async with following(engine_, state, max_message_bytes=1 << 20, replay_timeout_s=30) as c:
            await until(lambda: c.oversized_messages == 1, 3, "the dropped replay connection")
            assert c.decode_errors == 0 and c.batches == 0
            await subscribed(pub, c)  # live events still apply
            FakeVllm(pub).prefill(prompt(3, 900))
            await until(holds(state, kv(prompt(3, 900)), 3))


async def test_the_idle_probe_waits_for_a_pause_in_the_batches(ports: int, state: SharedState) -> None:
    # The probe replays from the last batch after probe_interval_s of silence: counted from the last batch
    # or probe, so a steady stream of batches is never probed, and a pause always is.
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with following(engine_, state, probe_interval_s=0.3) as c:
            await subscribed(pub, c)
            replays = c.replays
            for _ in range(12):  # 1.2 s of batches, 0.1 s apart
                pub.publish([])
                await asyncio.sleep(0.1)
            assert c.replays == replays
            await until(lambda: c.replays > replays, 1, "the probe after the pause")


async def test_a_message_over_the_size_limit_in_the_replay_buffer_is_skipped_not_asked_for_again(
    ports: int, state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    # Two large batches are lost live, and so is the one after them (the socket reopens meanwhile): only
    # the replay holds b, behind the large batches. Every replay asked for the large batch first and
    # dropped on it, so b never came, and each idle probe dropped the replay socket again.
    a, b = prompt(2, 0), prompt(2, 500)
    with (
        vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub,
        caplog.at_level(logging.WARNING, "kvgate.zmq_events"),
    ):
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with holding(engine, engine_, state, a, probe_interval_s=0.2) as c:
            pub.publish([], payload=b"\x00" * OVER)
            pub.publish([], payload=b"\x01" * OVER, drop=True)
            engine.prefill(b, drop=True)
            await until(holds(state, kv(b), 2), 5, "the batch behind the large ones, from the replay")
            # The live socket's drop, and the replay's on each large batch, once.
            await until(lambda: c.oversized_messages >= 3, 3, "the live socket's drop")
            replays = c.replays
            await until(lambda: c.replays >= replays + 3, 5, "three idle probes")
            assert c.oversized_messages == 3  # the probes replay from b on: nothing drops
            assert c.decode_errors == 0
        said = [r for r in caplog.records if "kv_event_max_message_bytes" in r.getMessage()]
        assert len(said) == 1


async def test_a_message_over_the_size_limit_sent_to_the_gateways_bound_socket_is_counted_once(
    ports: int, state: SharedState, caplog: pytest.LogCaptureFixture
) -> None:
    # The engine connects to the gateway: libzmq drops the accepted connection, the engine reconnects by
    # itself, and the batches after the large one arrive with a gap. The replay of the gap drops on the
    # large batch too: that drop is the one counted. The probe after the disconnect and the gap each asked
    # for the same replay, and each drop on it was counted.
    a, b = prompt(2, 0), prompt(2, 500)
    engine_ = engine_state(f"tcp://*:{ports}", f"tcp://*:{ports + 1}")
    with (
        caplog.at_level(logging.WARNING, "kvgate.zmq_events"),
        vp.VllmPublisher(f"tcp://127.0.0.1:{ports}", f"tcp://*:{ports + 1}") as pub,
    ):
        engine = FakeVllm(pub)
        async with holding(engine, engine_, state, a, replay_timeout_s=30) as c:
            pub.publish([], payload=b"\x00" * OVER)
            engine.prefill(b)
            await subscribed(pub, c)  # (live or replayed, b comes before the batch that ends this)
            assert holds(state, kv(b), 2)()
            await until(lambda: c.oversized_messages >= 1, 3, "the large message counted")
            await asyncio.sleep(GRACE_S * 2)  # (a second drop would be counted by now)
            assert c.oversized_messages == 1 and c.decode_errors == 0
    said = [r for r in caplog.records if "kv_event_max_message_bytes" in r.getMessage()]
    assert len(said) == 1


async def test_a_replay_drop_shown_before_the_batch_ahead_of_it_is_put_after_that_batch(
    ports: int, state: SharedState, monkeypatch: pytest.MonkeyPatch
) -> None:
    # libzmq reports a drop on the monitor before it hands the socket the batches it read in the same go as
    # the message that caused it (stream_engine_base_t::error: event_disconnected, then the session's
    # flush), so a poll in between sees the drop alone. The follower put such a drop on the answer's first
    # batch: the replay from its last batch seemed not to hold that batch, the rank was taken for
    # restarted, forgotten and replayed from 0, and that replay dropped on the large batch again, counted a
    # second time (the bound-socket test above, once in a few hundred runs). Here the first replay poll
    # that sees the answer's first batch waits for the drop to show behind it, and reports the drop alone
    # (unless that poll saw the drop alone already).
    shown_first: list[bool] = []

    class DropShownFirst(zmq.asyncio.Poller):
        def poll(self, timeout: int | None = -1) -> Awaitable[list[tuple[Any, int]]]:  # type: ignore[override]
            return self._shown_first(super().poll(timeout))

        async def _shown_first(self, polled: Awaitable[list[tuple[Any, int]]]) -> list[tuple[Any, int]]:
            ready = await polled
            if shown_first or not ready:
                return ready
            dealer = next((s for s, _ in ready if s.type == zmq.DEALER), None)
            if dealer is None:  # the drop alone: libzmq showed it first by itself
                shown_first.append(True)
                return ready
            monitor = next(s for s, _ in self.sockets if s is not dealer)
            shown_first.append(bool(await monitor.poll(2000)))
            return [(monitor, zmq.POLLIN)] if shown_first[0] else ready

    a, b = prompt(2, 0), prompt(2, 500)
    with vp.VllmPublisher(f"tcp://*:{ports}", f"tcp://*:{ports + 1}") as pub:
        engine = FakeVllm(pub)
        engine_ = engine_state(f"tcp://127.0.0.1:{ports}", f"tcp://127.0.0.1:{ports + 1}")
        async with holding(engine, engine_, state, a, replay_timeout_s=30) as c:
            monkeypatch.setattr(zmq.asyncio, "Poller", DropShownFirst)  # (for the replays from here on)
            pub.publish([], payload=b"\x00" * OVER, drop=True)  # in the replay buffer only: no live drop
            engine.prefill(b)  # a gap: the replay from a's batch drops on the large batch
            await until(holds(state, kv(b), 2), 5, "the batch after the large one")
            assert shown_first == [True]  # (the interleaving happened)
            assert c.oversized_messages == 1 and c.restarts == 0 and c.decode_errors == 0
