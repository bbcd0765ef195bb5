"""Follows a vLLM or SGLang engine's KV events over ZMQ into the residency index, outside the request path.

The engine publishes ``[topic, seq, payload]`` on a PUB socket and keeps its last batches for replay on a
ROUTER socket (``THIRD_PARTY_ENGINES.md``). Per data-parallel rank (ports base + rank) this consumer
subscribes, asks the replay socket for everything from seq 0 (what the engine already holds), then
applies live batches in seq order, translated to kvgate's hashes by ``cache.foreign_chain``.

Whenever the stream cannot be trusted, the consumer replays or resets; it never guesses
(``gateway.state.zmq_sequencer`` holds the rules, and how the index's own seqs are numbered). On silence for
``probe_interval_s`` it replays from the last batch anyway: PUB/SUB silently drops what is sent while a
connection is down, and a trailing lost batch shows no gap until the next one arrives.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from cache.foreign_chain import ForeignChain, routing_block
from gateway.config import GatewaySettings
from gateway.state.kv_events import EventSink
from gateway.state.zmq_drops import DropWatch, SocketDropped
from gateway.state.zmq_endpoints import gateway_binds, rank_endpoint, replay_address
from gateway.state.zmq_sequencer import RankState, ReplayDropped, ReplayUnavailable, ZmqEventSequencer
from region_map.fleet import EngineState

log = logging.getLogger("kvgate.zmq_events")

UNHEARD_BLOCKS = 8  # blocks sent to an engine, none announced: enough to say its events are not reaching us
_MIN_BLOCK_SIZE: int = GatewaySettings.model_fields["min_block_size"].default
_MAX_MESSAGE_BYTES: int = GatewaySettings.model_fields["kv_event_max_message_bytes"].default


class _IdentityChanged(Exception):
    """The engine's model or block size changed: every hash computed so far is in the wrong namespace."""


class ZmqKvEventConsumer(ZmqEventSequencer):
    """Follows one vLLM/SGLang engine (every data-parallel rank of it) into ``sink``.

    ``run()`` runs until cancelled; it waits for the engine's model to be known (its namespace names the
    hashes), and starts over if the model or block size changes. The counters are for metrics.
    ``min_block_size`` must be the gateway's (``GatewaySettings.min_block_size``): an engine of smaller
    blocks is indexed in the routing blocks the gateway hashes its prompts in. ``max_message_bytes`` is
    the gateway's ``kv_event_max_message_bytes``: larger messages are refused (``gateway.state.zmq_drops``).
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
        backoff_s: float = 0.2,
        max_backoff_s: float = 5.0,
        max_message_bytes: int = _MAX_MESSAGE_BYTES,
    ) -> None:
        endpoint = engine.config.kv_events_endpoint
        if endpoint is None:
            raise ValueError(f"engine {engine.id} has no kv_events_endpoint")
        super().__init__(engine, sink, replay_timeout_s=replay_timeout_s, max_message_bytes=max_message_bytes)
        self._context = context
        self._probe_interval_s = probe_interval_s
        self._model_poll_s = model_poll_s
        self._rcvhwm = rcvhwm
        self._min_block_size = min_block_size
        self._backoff_s = backoff_s  # the first pause before reopening a rank's socket after a failure
        self._max_backoff_s = max_backoff_s  # what the pause doubles up to while failures follow each other
        replay = engine.config.kv_events_replay_endpoint
        self._ranks = [
            RankState(
                rank,
                rank_endpoint(endpoint, rank),
                None if replay is None else rank_endpoint(replay_address(replay, engine.url), rank),
            )
            for rank in range(engine.config.data_parallel_size)
        ]
        self._topic = engine.config.kv_events_topic.encode()
        self.ready = asyncio.Event()  # set once every rank's history was read (or found unavailable)
        # Counters, besides the sequencer's
        self.disconnects = 0  # publisher connections that dropped
        self.errors = 0  # unexpected failures (bugs), logged with their traceback
        self._retired = {"unknown_parent_blocks": 0, "unindexable_blocks": 0, "ignored_blocks": 0}
        self._said_unheard = False  # the warning of _check_heard was given

    # -- metrics -----------------------------------------------------------------------------------------

    @property
    def unknown_parent_blocks(self) -> int:
        """Blocks skipped because their parent was never announced to us."""
        return self._chain_count("unknown_parent_blocks")

    @property
    def unindexable_blocks(self) -> int:
        """Blocks announced that cannot be indexed (multimodal, embeddings, an odd block size)."""
        return self._chain_count("unindexable_blocks")

    @property
    def ignored_blocks(self) -> int:
        """Blocks of another medium or KV cache group."""
        return self._chain_count("ignored_blocks")

    def _chain_count(self, name: str) -> int:
        """A chain counter since the start: the chains a model change retired, and the current one."""
        return self._retired[name] + (getattr(self.chain, name) if self.chain else 0)

    def last_seq(self, rank: int = 0) -> int | None:
        return self._ranks[rank].last_seq

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def run(self) -> None:
        context = self._active = self._context or zmq.asyncio.Context()
        try:
            while True:
                model = await self._wait_for_model()
                if self.chain is not None:
                    for name in self._retired:
                        self._retired[name] += getattr(self.chain, name)
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
            await self._stop_settling()
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

    async def _follow(self, context: zmq.asyncio.Context, state: RankState) -> None:
        backoff = self._backoff_s
        while True:
            state.heard = False
            try:
                await self._follow_once(context, state)
            except _IdentityChanged:
                raise
            except SocketDropped as exc:
                if exc.oversized:
                    self._count_oversized(state, "live")
                else:
                    log.warning("engine %s rank %d: KV event socket: %s", self.engine.id, state.rank, exc)
            except (zmq.ZMQError, OSError) as exc:
                log.warning("engine %s rank %d: KV event socket failed: %s", self.engine.id, state.rank, exc)
            except Exception:  # a bug must not stop the gateway from following the engine
                self.errors += 1
                log.exception("engine %s rank %d: following KV events failed", self.engine.id, state.rank)
            self._rank_ready(state)  # not ready, but waiting for it would wait for ever
            if state.heard:
                # This attempt reached the engine: its failure is a new one, not the latest of a run of
                # failures the pause grew for (a ZMQ connect succeeds whether or not anyone listens, so
                # hearing the engine is what tells a connection that worked).
                backoff = self._backoff_s
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _follow_once(self, context: zmq.asyncio.Context, state: RankState) -> None:
        sub = context.socket(zmq.SUB)
        watch: DropWatch | None = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, self._rcvhwm)
            sub.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
            if "[" in state.endpoint:
                sub.setsockopt(zmq.IPV6, 1)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            # A dropped connection means the engine may have restarted, and a restarted engine whose seq
            # happens to reach ours again would go unnoticed: after one, the next batch is checked first.
            # A connection dropped for a message over the limit is never reconnected: the watch says when
            # the socket went deaf, and it is reopened (with a replay from our last batch, as after a gap).
            binds = gateway_binds(state.endpoint)
            watch = DropWatch(sub, connects=not binds)
            if binds:
                sub.bind(state.endpoint)
            else:
                sub.connect(state.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(watch.monitor, zmq.POLLIN)
            # Subscribed before the replay is asked for: a batch published meanwhile arrives live, or is
            # in the replay, or both (then it is recognised and skipped).
            await self._probe(state)
            self._rank_ready(state)
            loop = asyncio.get_running_loop()
            # The idle probe comes probe_interval_s after the last batch or probe: not while batches flow,
            # and not held off by the monitor's events.
            next_probe = loop.time() + self._probe_interval_s
            while True:
                wake = next_probe if watch.deadline is None else min(next_probe, watch.deadline)
                ready = dict(await poller.poll(max(0, int((wake - loop.time()) * 1000) + 1)))
                self._check_identity()
                if watch.monitor in ready:
                    self._disconnected(state, await watch.read())
                if sub in ready:
                    frames = await sub.recv_multipart()
                    state.heard = True
                    if state.suspect and not state.replay_silent:
                        # (A replay socket known to be silent would hold every batch for its timeout: the
                        # idle probe asks it again, and checks our history once it answers.)
                        await self._probe(state)
                    await self._on_live(state, frames)
                    next_probe = loop.time() + self._probe_interval_s
                elif loop.time() >= next_probe:
                    await self._probe(state)
                    self._check_heard()
                    next_probe = loop.time() + self._probe_interval_s
                self._disconnected(state, await watch.check())
        finally:
            if watch is not None:
                watch.close()
            sub.close(linger=0)
            self._close_dealer(state)

    def _disconnected(self, state: RankState, disconnects: int) -> None:
        if disconnects:
            self.disconnects += disconnects
            state.suspect = True
            log.debug("engine %s rank %d: publisher disconnected", self.engine.id, state.rank)

    async def _probe(self, state: RankState) -> None:
        try:
            await self._catch_up(state)
            state.suspect = False
        except ReplayDropped:
            # The connection dropped mid-answer (a batch over the size limit first in the answer, or the
            # engine going away): asking again at every live batch would only drop again; the idle probe
            # and the next gap ask again. The socket answers, so it is not said to be silent.
            state.suspect = False
            return
        except ReplayUnavailable as exc:
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

    def _rank_ready(self, state: RankState) -> None:
        state.ready = True
        if all(s.ready for s in self._ranks):
            self.ready.set()
