"""Keeps the residency index true to one vLLM/SGLang engine's KV event streams (one per data-parallel rank):
applies their batches in seq order, translated by ``cache.foreign_chain``, and replays or resets whenever a
stream cannot be trusted; ``gateway.state.zmq_events`` drives it from the engine's sockets.

It never guesses:

- a gap in seq: replay from the last applied batch, whose bytes must match what was applied (otherwise
  the engine restarted in between and its seq merely passed ours), then apply what follows;
- seq going back, a replayed batch that differs, an SGLang epoch that changed: the rank restarted;
  forget what it held and replay its new history from 0;
- a gap that replay cannot fill (no replay socket, or the engine's buffer has moved on), an unreadable
  batch: forget what the rank held (the index under-predicts until the engine announces blocks again);
- a batch over the size limit in the replay (libzmq drops the connection on it): skip it, and replay what
  follows it, a gap the replay cannot fill.

Index seq: the residency index applies a batch only if its seq is newer than the last one for the engine,
and other engines' seqs restart at 0 and are per rank. So the sequencer numbers index batches itself: each
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

from cache.cancelling import cancel_and_wait
from cache.events import EventDecodeError, KvEventBatch
from cache.foreign_chain import ForeignChain
from cache.foreign_events import ForeignBatch, decode_foreign_batch
from gateway.state.kv_events import EventSink
from gateway.state.zmq_drops import DropWatch
from region_map.fleet import EngineState

log = logging.getLogger("kvgate.zmq_events")  # the follower's log, whichever of its parts speaks

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_EPOCH_MARKER = b"\x00sgl-kv-epoch="  # SGLang with snapshots: topic + marker + publisher lifetime id
_UNKNOWN_TYPES_SAID = 32  # distinct unknown event types warned about, per engine
_DIGESTS_KEPT = 4096  # recent batches recognised when they arrive again (live copies of replayed ones)


class ReplayUnavailable(Exception):
    """The replay socket did not answer (engine down, or no such socket)."""


class ReplayDropped(ReplayUnavailable):
    """The replay socket's connection dropped while an answer was awaited (the rest of it is lost)."""


class ReplayOversized(ReplayDropped):
    """libzmq dropped the replay socket's connection for a batch over the size limit: the one after
    ``after``, the last batch of the answer that came (None: the answer's first, whose seq is unknown)."""

    def __init__(self, endpoint: str, after: int | None) -> None:
        super().__init__(f"{endpoint} sent a batch over the size limit")
        self.after = after


def _epoch(topic: bytes) -> bytes | None:
    at = topic.find(_EPOCH_MARKER)
    if at < 0:
        return None
    return topic[at + len(_EPOCH_MARKER) :].split(b"\x00", 1)[0]


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _answer(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A replay answer's ``(seq, payload)``, or None for its end marker. Its frames are
    ``[b"", seq, payload]`` (older vLLM, SGLang) or ``[b"", topic, seq, payload]`` (vLLM 0.32)."""
    if len(frames) not in (3, 4) or frames[0] != b"" or len(frames[-2]) != 8:
        raise ReplayUnavailable(f"malformed replay answer ({len(frames)} frames)")
    if frames[-2] == END_SEQ:
        return None
    return int.from_bytes(frames[-2], "big"), frames[-1]


@dataclass(slots=True)
class RankState:
    """What is known of one data-parallel rank's stream: the last batch applied, and its sockets' state."""

    rank: int
    endpoint: str
    replay_endpoint: str | None
    last_seq: int | None = None  # the engine's seq of the last batch applied; None: no history yet
    digests: OrderedDict[int, int] = field(default_factory=OrderedDict)  # seq -> payload digest
    epoch: bytes | None = None
    dealer: zmq.asyncio.Socket | None = None
    dealer_watch: DropWatch | None = None  # the dealer's monitor: a dropped connection fails its request
    warned_rank: bool = False
    ready: bool = False
    suspect: bool = False  # the connection dropped since the last check of our history against the engine's
    replay_silent: bool = False  # its replay socket stopped answering (said once, as a warning)
    heard: bool = False  # the engine answered (a live batch, a whole replay) since its socket was opened
    # The replay from seq 0 dropped on its first batch, one over the size limit (its seq unknown, so it
    # cannot be skipped): until the rank has a history to replay from, it is not asked for again.
    head_oversized: bool = False

    def remember(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.digests[seq] = _digest(payload)
        while len(self.digests) > _DIGESTS_KEPT:
            self.digests.popitem(last=False)

    def forget(self) -> None:
        self.last_seq = None
        self.digests.clear()
        self.head_oversized = False  # (asked again once: a restarted engine's buffer is a new one)


class ZmqEventSequencer:
    """Applies one engine's KV event batches, rank by rank, into ``sink`` in seq order, recovering through
    the engine's replay socket (or by forgetting a rank) when a rank's stream cannot be trusted. The
    counters are for metrics; ``gateway.state.zmq_events.ZmqKvEventConsumer`` is the follower built on it."""

    def __init__(
        self, engine: EngineState, sink: EventSink, *, replay_timeout_s: float, max_message_bytes: int
    ) -> None:
        self.engine = engine
        self._sink = sink
        self._replay_timeout_s = replay_timeout_s
        self._max_message_bytes = max_message_bytes  # ZMQ_MAXMSGSIZE of every socket the follower opens
        self._lock = asyncio.Lock()  # one index write at a time, across ranks, in index-seq order
        self._index_seq = 0
        self._active: zmq.asyncio.Context | None = None  # the context replay sockets open in, while running
        self.chain: ForeignChain | None = None
        # Counters
        self.batches = 0  # engine batches applied
        self.resyncs = 0  # times the engine's index entries were replaced wholesale
        self.replays = 0  # replay requests sent
        self.gaps = 0  # seq gaps seen on the live stream
        self.restarts = 0  # rank restarts detected (seq back, changed history or epoch)
        self.decode_errors = 0  # batches that could not be read (treated as lost)
        self.unknown_events = 0  # events of a type we do not know (a newer engine), skipped
        self._unknown_said: set[str] = set()  # unknown types already warned about
        self.oversized_messages = 0  # connections libzmq dropped for a message over max_message_bytes
        self._said_oversized = False
        # Dropped replay sockets, closed once it is known whether a message over the limit dropped them.
        self._settling: set[asyncio.Task[None]] = set()

    # -- a rank's live stream ----------------------------------------------------------------------------

    async def _on_live(self, state: RankState, frames: list[bytes]) -> None:
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
            if not state.replay_silent:  # (known silent: waiting for its timeout would only fall behind)
                with suppress(ReplayUnavailable):
                    await self._catch_up(state)
            why = (
                "a gap the replay could not fill" if state.replay_endpoint else "a gap, and no replay socket"
            )
            await self._continue_with(state, seq, payload, why)

    async def _continue_with(self, state: RankState, seq: int, payload: bytes, why: str) -> None:
        """Apply a live batch after a recovery, unless the recovery already covered it."""
        last = state.last_seq
        if last is not None and seq <= last:
            return
        if last is not None and seq != last + 1:
            await self._lose(state, why)
        await self._apply(state, seq, payload)

    async def _restart(self, state: RankState, seq: int, payload: bytes, why: str) -> None:
        self.restarts += 1
        await self._lose(state, f"engine restarted ({why})")
        with suppress(ReplayUnavailable):
            await self._catch_up(state)
        await self._continue_with(state, seq, payload, "its new history is incomplete")

    async def _lose(self, state: RankState, why: str) -> None:
        """Forget everything the rank held: the index keeps only what the other ranks hold."""
        chain = self.chain
        assert chain is not None
        async with self._lock:
            chain.reset_rank(state.rank)
            state.forget()
            await self._resync_index(f"rank {state.rank}: {why}")

    # -- replay ------------------------------------------------------------------------------------------

    async def _catch_up(self, state: RankState) -> None:
        """Apply whatever the engine's replay buffer holds after our last batch, after checking that what
        it buffers under our last seq is the batch we applied. Raises ``ReplayUnavailable`` when the
        replay socket does not answer; does nothing without one."""
        if state.replay_endpoint is None:
            return
        verify = state.last_seq is not None
        if not verify and state.head_oversized:
            return
        start = state.last_seq if state.last_seq is not None else 0
        checked = diverged = False
        with suppress(ReplayOversized):  # (on our last batch's place: it is not buffered, as below)
            async with aclosing(self._replay_past_oversized(state, start)) as answers:
                async for seq, payload in answers:
                    if verify and not checked:
                        checked = True
                        diverged = seq != start or state.digests.get(seq) != _digest(payload)
                    elif not diverged:  # once diverged, the answer is only drained: history is read again
                        await self._continue_with(state, seq, payload, "the replay buffer skipped batches")
        if not verify or (checked and not diverged):
            return
        # The batch we applied last is not buffered under its seq: the rank restarted, or we fell further
        # behind than its buffer reaches. What we hold for it is no longer known to be true.
        self.restarts += 1
        await self._lose(state, "its history differs from ours")
        async with aclosing(self._replay_past_oversized(state, 0)) as answers:
            async for seq, payload in answers:
                await self._continue_with(state, seq, payload, "the replay buffer skipped batches")

    async def _replay_past_oversized(
        self, state: RankState, start: int
    ) -> AsyncGenerator[tuple[int, bytes], None]:
        """``_replay``, skipping the batches over the size limit: libzmq drops the connection on one, and
        every later request would drop on it again for as long as the engine buffers it. The replay is
        asked for again from the batch after it; the caller sees the gap in seq, and forgets the rank as
        for any gap the replay cannot fill. Raises ``ReplayOversized`` if the answer's first batch is over
        the limit (no seq to skip to: from seq 0, the rank is not replayed until it has a history)."""
        after: int | None = None  # the last batch the answers gave, or skipped
        while True:
            try:
                async with aclosing(self._replay(state, start)) as answers:
                    async for seq, payload in answers:
                        after = seq
                        yield seq, payload
                return
            except ReplayOversized:
                if after is None:
                    state.head_oversized = state.last_seq is None
                    raise
                after += 1  # the batch over the limit (each try starts further on: the end is reached)
                start = after + 1

    async def _replay(self, state: RankState, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """Yield ``(seq, payload)`` for every buffered batch with seq >= start, as the engine answers."""
        assert state.replay_endpoint is not None
        if state.dealer is None:
            self._open_dealer(state, state.replay_endpoint)
        dealer, watch = state.dealer, state.dealer_watch
        assert dealer is not None and watch is not None
        await watch.read()  # (a disconnect before this request was reconnected by libzmq; not ours)
        poller = zmq.asyncio.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(watch.monitor, zmq.POLLIN)
        loop = asyncio.get_running_loop()
        self.replays += 1
        complete = False
        last: int | None = None  # the seq of the answer's last batch
        try:
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                deadline = loop.time() + self._replay_timeout_s  # for each message of the answer
                while True:
                    ready = dict(await poller.poll(max(0, int((deadline - loop.time()) * 1000))))
                    if dealer in ready:
                        break  # (what came before a drop is read first: the drop is on the batch after)
                    if watch.monitor in ready and await watch.read():
                        # The ROUTER forgets a peer that disconnects: the rest of the answer will never
                        # come, so the request fails now rather than at its timeout. Whether the next
                        # batch was over the size limit shows within the grace period, and so do the
                        # batches that came before it but were not readable yet.
                        oversized, queued = await self._dropped(state)
                        for frames in queued:
                            answer = _answer(frames)
                            if answer is None:
                                complete = state.heard = True  # (the drop came after the answer)
                                return
                            last = answer[0]
                            yield answer
                        endpoint = str(state.replay_endpoint)
                        if oversized:
                            raise ReplayOversized(endpoint, last)
                        raise ReplayDropped(f"{endpoint} dropped the connection")
                    if loop.time() >= deadline:
                        raise ReplayUnavailable(f"no answer from {state.replay_endpoint}")
                answer = _answer(await dealer.recv_multipart())
                if answer is None:
                    complete = state.heard = True
                    return
                last = answer[0]
                yield answer
        finally:
            if not complete:
                # The rest of an unfinished answer would be read as the answer to the next request.
                self._close_dealer(state)

    def _open_dealer(self, state: RankState, endpoint: str) -> None:
        context = self._active
        assert context is not None
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        if "[" in endpoint:
            dealer.setsockopt(zmq.IPV6, 1)
        state.dealer_watch = DropWatch(dealer, connects=True)  # (the ROUTER is always the engine's)
        dealer.connect(endpoint)
        state.dealer = dealer

    async def _dropped(self, state: RankState) -> tuple[bool, list[list[bytes]]]:
        """The replay socket's connection dropped during an answer: close the socket once it shows why.
        Returns whether a message over the size limit dropped it (counted here), and the answer's messages
        that came before the drop, read only now: libzmq reports the drop on the monitor before it hands
        the socket the batches it read in the same go as the large message, so a poll in between sees the
        drop alone. (Put on the answer's first batch, the drop made a replay from our last batch seem not
        to hold it: the rank was taken for restarted and replayed from 0, dropping on the same message
        again.) They are handed over at once, well within the grace period that ``settle`` waits."""
        dealer, watch = state.dealer, state.dealer_watch
        assert dealer is not None and watch is not None
        state.dealer = state.dealer_watch = None
        queued: list[list[bytes]] = []
        try:
            oversized = await watch.settle()
            while await dealer.poll(0):
                queued.append(await dealer.recv_multipart())
        finally:
            watch.close()
            dealer.close(linger=0)
        if oversized:
            self._count_oversized(state, "replay")
        return oversized, queued

    def _close_dealer(self, state: RankState) -> None:
        dealer, watch = state.dealer, state.dealer_watch
        state.dealer = state.dealer_watch = None
        if dealer is None or watch is None:
            return
        if watch.deadline is None:
            watch.close()
            dealer.close(linger=0)
            return
        # Its connection dropped: whether for a message over the limit shows only once libzmq does not
        # reconnect within the grace period. The request already failed; the socket is closed after that.
        task = asyncio.get_running_loop().create_task(self._settle(state, dealer, watch))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, state: RankState, dealer: zmq.asyncio.Socket, watch: DropWatch) -> None:
        try:
            if await watch.settle():
                self._count_oversized(state, "replay")
        finally:
            watch.close()
            dealer.close(linger=0)

    async def _stop_settling(self) -> None:
        """Close the dropped replay sockets still settling (the follower stops)."""
        await cancel_and_wait(*self._settling)

    def _count_oversized(self, state: RankState, socket: str) -> None:
        self.oversized_messages += 1
        if self._said_oversized:  # once per engine: every drop is counted in the metrics
            return
        self._said_oversized = True
        log.warning(
            "engine %s rank %d: its %s KV event socket got a message over gateway.kv_event_max_message_bytes "
            "(%d bytes); libzmq dropped the connection, so the socket is reopened and the message is lost "
            "(raise the setting if the engine's batches are that large; further drops are counted in "
            "kvgate_kv_event_oversized_messages_total, not logged)",
            self.engine.id, state.rank, socket, self._max_message_bytes,
        )  # fmt: skip

    # -- applying ----------------------------------------------------------------------------------------

    async def _apply(self, state: RankState, seq: int, payload: bytes) -> None:
        try:
            batch = decode_foreign_batch(payload)
        except EventDecodeError as exc:
            self.decode_errors += 1
            log.warning("engine %s rank %d: unreadable batch %d (%s)", self.engine.id, state.rank, seq, exc)
            await self._lose(state, "an unreadable batch")
            state.remember(seq, payload)
            return
        self._check_rank(state, batch)
        if batch.unknown_events:
            self._count_unknown(state, seq, batch.unknown_events)
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

    def _count_unknown(self, state: RankState, seq: int, tags: tuple[str, ...]) -> None:
        self.unknown_events += len(tags)
        new = set(tags) - self._unknown_said
        if new and len(self._unknown_said) < _UNKNOWN_TYPES_SAID:  # bounded: the tags come off the wire
            self._unknown_said.update(new)
            log.warning(
                "engine %s rank %d: batch %d has events of types this gateway does not know (%s); "
                "skipping them and applying the rest",
                self.engine.id,
                state.rank,
                seq,
                ", ".join(sorted(new)),
            )

    def _check_rank(self, state: RankState, batch: ForeignBatch) -> None:
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
