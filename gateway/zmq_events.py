"""Follows a vLLM or SGLang engine's KV events over ZMQ into the residency index, outside the request path.

The engine publishes ``[topic, seq, payload]`` on a PUB socket and keeps its last batches for replay on a
ROUTER socket (``THIRD_PARTY_ENGINES.md``). Per data-parallel rank (ports base + rank) this consumer
subscribes, asks the replay socket for everything from seq 0 (what the engine already holds), then
applies live batches in seq order, translated to kvgate's hashes by ``cache.foreign_chain``.

Whenever the stream cannot be trusted, the consumer replays or resets; it never guesses:

- a gap in seq: replay from the last applied batch, whose bytes must match what was applied (otherwise
  the engine restarted in between and its seq merely passed ours), then apply what follows;
- seq going back, a replayed batch that differs, an SGLang epoch that changed: the rank restarted;
  forget what it held and replay its new history from 0;
- a gap that replay cannot fill (no replay socket, or the engine's buffer has moved on), an unreadable
  batch: forget what the rank held (the index under-predicts until the engine announces blocks again);
- silence for ``probe_interval_s``: replay from the last batch anyway. PUB/SUB silently drops what is sent
  while a connection is down, and a trailing lost batch shows no gap until the next one arrives.

Index seq: the residency index applies a batch only if its seq is newer than the last one for the engine,
and other engines' seqs restart at 0 and are per rank. So the consumer numbers index batches itself: each
resync takes a new base from the wall clock in microseconds (also newer than what a previous gateway
process wrote, unless the clock went back or it applied a million batches a second), each batch adds 1.
A resync sets the index seq unconditionally, so one resync re-bases the engine in any case.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing, suppress
from dataclasses import dataclass, field

import xxhash
import zmq
import zmq.asyncio

from cache.events import EventDecodeError, KvEventBatch
from cache.foreign_chain import ForeignChain, routing_block
from cache.foreign_events import ForeignBatch, decode_foreign_batch
from gateway.config import GatewaySettings
from gateway.kv_events import EventSink
from gateway.zmq_endpoints import gateway_binds, rank_endpoint, replay_address
from region_map.fleet import EngineState

log = logging.getLogger("kvgate.zmq_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_EPOCH_MARKER = b"\x00sgl-kv-epoch="  # SGLang with snapshots: topic + marker + publisher lifetime id
UNHEARD_BLOCKS = 8  # blocks sent to an engine, none announced: enough to say its events are not reaching us
_DIGESTS_KEPT = 4096  # recent batches recognised when they arrive again (live copies of replayed ones)
_MIN_BLOCK_SIZE: int = GatewaySettings.model_fields["min_block_size"].default


class _ReplayUnavailable(Exception):
    """The replay socket did not answer (engine down, or no such socket)."""


class _IdentityChanged(Exception):
    """The engine's model or block size changed: every hash computed so far is in the wrong namespace."""


def _epoch(topic: bytes) -> bytes | None:
    at = topic.find(_EPOCH_MARKER)
    if at < 0:
        return None
    return topic[at + len(_EPOCH_MARKER) :].split(b"\x00", 1)[0]


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(slots=True)
class _RankState:
    rank: int
    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None  # the engine's seq of the last batch applied; None: no history yet
    digests: OrderedDict[int, int] = field(default_factory=OrderedDict)  # seq -> payload digest
    epoch: bytes | None = None
    dealer: zmq.asyncio.Socket | None = None
    warned_rank: bool = False
    ready: bool = False
    suspect: bool = False  # the connection dropped since the last check of our history against the engine's
    replay_silent: bool = False  # its replay socket stopped answering (said once, as a warning)

    def remember(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.digests[seq] = _digest(payload)
        while len(self.digests) > _DIGESTS_KEPT:
            self.digests.popitem(last=False)

    def forget(self) -> None:
        self.last_seq = None
        self.digests.clear()


class ZmqKvEventConsumer:
    """Follows one vLLM/SGLang engine (every data-parallel rank of it) into ``sink``.

    ``run()`` runs until cancelled; it waits for the engine's model to be known (its namespace names the
    hashes), and starts over if the model or block size changes. The counters are for metrics.
    ``min_block_size`` must be the gateway's (``GatewaySettings.min_block_size``): an engine of smaller
    blocks is indexed in the routing blocks the gateway hashes its prompts in.
    """

    def __init__(
        self,
        engine: EngineState,
        sink: EventSink,
        *,
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = 5.0,
        probe_interval_s: float = 10.0,
        model_poll_s: float = 0.5,
        rcvhwm: int = 100_000,
        min_block_size: int = _MIN_BLOCK_SIZE,
    ) -> None:
        endpoint = engine.config.kv_events_endpoint
        if endpoint is None:
            raise ValueError(f"engine {engine.id} has no kv_events_endpoint")
        self.engine = engine
        self._sink = sink
        self._context = context
        self._replay_timeout_s = replay_timeout_s
        self._probe_interval_s = probe_interval_s
        self._model_poll_s = model_poll_s
        self._rcvhwm = rcvhwm
        self._min_block_size = min_block_size
        replay = engine.config.kv_events_replay_endpoint
        self._ranks = [
            _RankState(
                rank,
                rank_endpoint(endpoint, rank),
                None if replay is None else rank_endpoint(replay_address(replay, engine.url), rank),
            )
            for rank in range(engine.config.data_parallel_size)
        ]
        self._topic = engine.config.kv_events_topic.encode()
        self._lock = asyncio.Lock()  # one index write at a time, across ranks, in index-seq order
        self._index_seq = 0
        self._active: zmq.asyncio.Context | None = None
        self.chain: ForeignChain | None = None
        self.ready = asyncio.Event()  # set once every rank's history was read (or found unavailable)
        # Counters
        self.batches = 0  # engine batches applied
        self.resyncs = 0  # times the engine's index entries were replaced wholesale
        self.replays = 0  # replay requests sent
        self.gaps = 0  # seq gaps seen on the live stream
        self.restarts = 0  # rank restarts detected (seq back, changed history or epoch)
        self.decode_errors = 0  # batches that could not be read (treated as lost)
        self.disconnects = 0  # publisher connections that dropped
        self.errors = 0  # unexpected failures (bugs), logged with their traceback
        self._retired_unknown = 0
        self._said_unheard = False  # the warning of _check_heard was given

    # -- metrics -----------------------------------------------------------------------------------------

    @property
    def unknown_parent_blocks(self) -> int:
        """Blocks skipped because their parent was never announced to us."""
        return self._retired_unknown + (self.chain.unknown_parent_blocks if self.chain else 0)

    def last_seq(self, rank: int = 0) -> int | None:
        return self._ranks[rank].last_seq

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        context = self._active = self._context or zmq.asyncio.Context()
        try:
            while True:
                model = await self._wait_for_model()
                if self.chain is not None:
                    self._retired_unknown += self.chain.unknown_parent_blocks
                self.chain = ForeignChain(
                    model, block_size=self.engine.block_size, routing_block=self._routing_block()
                )
                for state in self._ranks:
                    state.forget()
                    state.epoch = None
                    state.ready = False
                self.ready.clear()
                async with self._lock:
                    await self._resync_index("following the engine's events")
                try:
                    async with asyncio.TaskGroup() as group:
                        for state in self._ranks:
                            group.create_task(self._follow(context, state))
                except* _IdentityChanged:
                    log.info("engine %s: model or block size changed; starting over", self.engine.id)
        finally:
            self._active = None
            if self._context is None:
                context.destroy(linger=0)

    async def _wait_for_model(self) -> str:
        while True:
            model = self.engine.model
            if model is not None:
                return model
            await asyncio.sleep(self._model_poll_s)

    def _check_identity(self) -> None:
        chain = self.chain
        assert chain is not None
        block_size = self.engine.block_size
        if self.engine.model != chain.model:
            raise _IdentityChanged
        if block_size != chain.block_size:
            # Learnt after we started: filter from now on, unless its routing block spans several of its
            # blocks (groups need every page from the chain's root on: start over).
            if chain.block_size is not None or self._routing_block() != block_size:
                raise _IdentityChanged
            chain.block_size = block_size

    def _routing_block(self) -> int | None:
        """The block size the gateway hashes this engine's prompts in (``EngineState.chain_key``)."""
        block_size = self.engine.block_size
        return None if block_size is None else routing_block(block_size, self._min_block_size)

    # -- one rank ----------------------------------------------------------------------------------------

    async def _follow(self, context: zmq.asyncio.Context, state: _RankState) -> None:
        backoff = 0.2
        while True:
            try:
                await self._follow_once(context, state)
            except _IdentityChanged:
                raise
            except (zmq.ZMQError, OSError) as exc:
                log.warning("engine %s rank %d: KV event socket failed: %s", self.engine.id, state.rank, exc)
            except Exception:  # a bug must not stop the gateway from following the engine
                self.errors += 1
                log.exception("engine %s rank %d: following KV events failed", self.engine.id, state.rank)
            self._rank_ready(state)  # not ready, but waiting for it would wait for ever
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _follow_once(self, context: zmq.asyncio.Context, state: _RankState) -> None:
        sub = context.socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            if "[" in state.endpoint:
                sub.setsockopt(zmq.IPV6, 1)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            # A dropped connection means the engine may have restarted, and a restarted engine whose seq
            # happens to reach ours again would go unnoticed: after one, the next batch is checked first.
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            if gateway_binds(state.endpoint):
                sub.bind(state.endpoint)
            else:
                sub.connect(state.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            # Subscribed before the replay is asked for: a batch published meanwhile arrives live, or is
            # in the replay, or both (then it is recognised and skipped).
            await self._probe(state)
            self._rank_ready(state)
            probe_ms = int(self._probe_interval_s * 1000)
            while True:
                ready = dict(await poller.poll(probe_ms))
                self._check_identity()
                if monitor in ready:
                    while await monitor.poll(0):
                        await monitor.recv_multipart()
                    self.disconnects += 1
                    state.suspect = True
                    log.debug("engine %s rank %d: publisher disconnected", self.engine.id, state.rank)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    if state.suspect:
                        await self._probe(state)
                    await self._on_live(state, frames)
                elif not ready:
                    await self._probe(state)
                    self._check_heard()
        finally:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            self._close_dealer(state)

    async def _probe(self, state: _RankState) -> None:
        try:
            await self._catch_up(state)
            state.suspect = False
        except _ReplayUnavailable as exc:
            # Said once per silence: a wrong endpoint or a firewalled port would otherwise leave the engine
            # routed on what the gateway can guess, with nothing in the log to say why.
            if not state.replay_silent:
                log.warning(
                    "engine %s rank %d: its KV event replay socket does not answer (%s); its residency is "
                    "what its live events say from now on (check kv_events_replay_endpoint)",
                    self.engine.id, state.rank, exc,
                )  # fmt: skip
            state.replay_silent = True
            return
        if state.replay_silent:
            log.info(
                "engine %s rank %d: its KV event replay socket answers again", self.engine.id, state.rank
            )
            state.replay_silent = False

    def _check_heard(self) -> None:
        """Say once when the engine was sent new blocks and not one batch has come: the endpoint (or the
        engine's --kv-events-config) is wrong, and routing there rests on short-lived notes alone."""
        if self.batches or self._said_unheard or self.engine.awaited_blocks < UNHEARD_BLOCKS:
            return
        self._said_unheard = True
        log.warning(
            "engine %s: sent %d new blocks, and no KV event has arrived from %s: check kv_events_endpoint "
            "and the engine's --kv-events-config; until events arrive, its residency is this gateway's "
            "short-lived notes of where it sent prompts",
            self.engine.id, self.engine.awaited_blocks, self.engine.config.kv_events_endpoint,
        )  # fmt: skip

    def _rank_ready(self, state: _RankState) -> None:
        state.ready = True
        if all(s.ready for s in self._ranks):
            self.ready.set()

    async def _on_live(self, state: _RankState, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.debug(
                "engine %s rank %d: ignoring a message of %d frames", self.engine.id, state.rank, len(frames)
            )
            return
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        epoch = _epoch(topic)
        if epoch is not None and epoch != state.epoch:
            known = state.epoch is not None
            state.epoch = epoch
            if known:
                await self._restart(state, seq, payload, "its epoch changed")
                return
        last = state.last_seq
        if last is None or seq == last + 1:
            await self._apply(state, seq, payload)
        elif seq <= last:
            if state.digests.get(seq) == _digest(payload):
                return  # a live copy of a batch the replay already gave us
            await self._restart(state, seq, payload, f"seq went back from {last} to {seq}")
        else:
            self.gaps += 1
            log.debug("engine %s rank %d: seq gap %d..%d", self.engine.id, state.rank, last + 1, seq - 1)
            with suppress(_ReplayUnavailable):
                await self._catch_up(state)
            why = (
                "a gap the replay could not fill" if state.replay_endpoint else "a gap, and no replay socket"
            )
            await self._continue_with(state, seq, payload, why)

    async def _continue_with(self, state: _RankState, seq: int, payload: bytes, why: str) -> None:
        """Apply a live batch after a recovery, unless the recovery already covered it."""
        last = state.last_seq
        if last is not None and seq <= last:
            return
        if last is not None and seq != last + 1:
            await self._lose(state, why)
        await self._apply(state, seq, payload)

    async def _restart(self, state: _RankState, seq: int, payload: bytes, why: str) -> None:
        self.restarts += 1
        await self._lose(state, f"engine restarted ({why})")
        with suppress(_ReplayUnavailable):
            await self._catch_up(state)
        await self._continue_with(state, seq, payload, "its new history is incomplete")

    async def _lose(self, state: _RankState, why: str) -> None:
        """Forget everything the rank held: the index keeps only what the other ranks hold."""
        chain = self.chain
        assert chain is not None
        async with self._lock:
            chain.reset_rank(state.rank)
            state.forget()
            await self._resync_index(f"rank {state.rank}: {why}")

    # -- replay ------------------------------------------------------------------------------------------

    async def _catch_up(self, state: _RankState) -> None:
        """Apply whatever the engine's replay buffer holds after our last batch, after checking that what
        it buffers under our last seq is the batch we applied. Raises ``_ReplayUnavailable`` when the
        replay socket does not answer; does nothing without one."""
        if state.replay_endpoint is None:
            return
        verify = state.last_seq is not None
        start = state.last_seq if state.last_seq is not None else 0
        checked = diverged = False
        async with aclosing(self._replay(state, start)) as answers:
            async for seq, payload in answers:
                if verify and not checked:
                    checked = True
                    diverged = seq != start or state.digests.get(seq) != _digest(payload)
                elif not diverged:  # once diverged, the answer is only drained: history is read again
                    await self._continue_with(state, seq, payload, "the replay buffer skipped batches")
        if verify and (diverged or not checked):
            # The batch we applied last is not buffered under its seq: the rank restarted, or we fell
            # further behind than its buffer reaches. What we hold for it is no longer known to be true.
            self.restarts += 1
            await self._lose(state, "its history differs from ours")
            async with aclosing(self._replay(state, 0)) as answers:
                async for seq, payload in answers:
                    await self._continue_with(state, seq, payload, "the replay buffer skipped batches")

    async def _replay(self, state: _RankState, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """Yield ``(seq, payload)`` for every buffered batch with seq >= start, as the engine answers."""
        assert state.replay_endpoint is not None
        dealer = state.dealer
        if dealer is None:
            dealer = state.dealer = self._open_dealer(state.replay_endpoint)
        self.replays += 1
        complete = False
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            timeout_ms = int(self._replay_timeout_s * 1000)
            while True:
                if not await dealer.poll(timeout_ms):
                    raise _ReplayUnavailable(f"no answer from {state.replay_endpoint}")
                frames = await dealer.recv_multipart()
                # [b"", seq, payload] (older vLLM, SGLang) or [b"", topic, seq, payload] (vLLM 0.32).
                if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
                    raise _ReplayUnavailable(f"malformed replay answer ({len(frames)} frames)")
                if frames[-2] == END_SEQ:
                    complete = True
                    return
                yield int.from_bytes(frames[-2], "big"), frames[-1]
        finally:
            if not complete:
                # The rest of an unfinished answer would be read as the answer to the next request.
                self._close_dealer(state)

    def _open_dealer(self, endpoint: str) -> zmq.asyncio.Socket:
        context = self._active
        assert context is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        if "[" in endpoint:
            dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(endpoint)
        return dealer

    def _close_dealer(self, state: _RankState) -> None:
        if state.dealer is not None:
            state.dealer.close(linger=0)
            state.dealer = None

    # -- applying ----------------------------------------------------------------------------------------

    async def _apply(self, state: _RankState, seq: int, payload: bytes) -> None:
        try:
            batch = decode_foreign_batch(payload)
        except EventDecodeError as exc:
            self.decode_errors += 1
            log.warning("engine %s rank %d: unreadable batch %d (%s)", self.engine.id, state.rank, seq, exc)
            await self._lose(state, "an unreadable batch")
            state.remember(seq, payload)
            return
        self._check_rank(state, batch)
        chain = self.chain
        assert chain is not None
        async with self._lock:
            events = chain.apply(batch.events, state.rank)
            state.remember(seq, payload)
            self.batches += 1
            if not events:
                return
            self._index_seq += 1
            kv_batch = KvEventBatch(self.engine.id, self._index_seq, batch.ts, tuple(events))
            if not await self._sink.apply_events(self.engine.id, kv_batch):
                # Someone else wrote a newer seq for this engine: make the index ours again.
                await self._resync_index("the index refused a batch")

    def _check_rank(self, state: _RankState, batch: ForeignBatch) -> None:
        rank = batch.data_parallel_rank
        if rank is not None and rank != state.rank and not state.warned_rank:
            state.warned_rank = True
            log.warning(
                "engine %s: batches on %s say rank %d, expected %d (check data_parallel_size and ports)",
                self.engine.id,
                state.endpoint,
                rank,
                state.rank,
            )

    async def _resync_index(self, why: str) -> None:
        """Replace the engine's index entries with what the chain holds, under a new index-seq base.
        The caller holds ``self._lock``."""
        chain = self.chain
        assert chain is not None
        self._index_seq = max(self._index_seq + 1, time.time_ns() // 1000)
        held = chain.held()
        await self._sink.resync(self.engine.id, held, self._index_seq)
        self.resyncs += 1
        log.info("engine %s: index resynchronised to %d blocks (%s)", self.engine.id, len(held), why)
