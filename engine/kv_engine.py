"""The engine's side of K/V transfer, mixed into :class:`~engine.llm_engine.LLMEngine`: prefills that export
their K/V to a decode engine, sequences that import theirs from a prefill engine or pull it from a peer's
prefix cache, and serving a peer's pull from this engine's cache."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from functools import cached_property
from typing import TYPE_CHECKING

from engine.engine_types import ImportTicket, RequestRejected
from engine.kv_export import PinnedRun, send_cached, send_positions
from engine.kv_staging import HostBuffers
from engine.kv_transfer import position_slots
from engine.sequence import CacheNamespace, SamplingParams, SeqStatus, Sequence

if TYPE_CHECKING:
    from engine.attention import KVCache
    from engine.block_manager import BlockManager
    from engine.kv_export import ExportSink
    from engine.llm_engine import EngineConfig
    from engine.metrics import EngineCounters
    from engine.scheduler import Scheduler


class KvTransferMixin:
    """K/V import, export and pull for :class:`~engine.llm_engine.LLMEngine`, which owns the state below."""

    kv_frame_bytes = 4 << 20  # the payload of one K/V frame at most: a long prompt's layer goes in several

    if TYPE_CHECKING:
        config: EngineConfig
        kv_cache: KVCache | None
        blocks: BlockManager
        scheduler: Scheduler
        counters: EngineCounters
        _seqs: dict[str, Sequence]
        _transferred: dict[str, int]

        def check_request(self, prompt: Seq[int], params: SamplingParams) -> None: ...

        def _sequence(
            self, request_id: str, prompt: list[int], params: SamplingParams, namespace: CacheNamespace
        ) -> Sequence: ...

        def _forget(self, request_id: str) -> None: ...

    def add_export(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        namespace: CacheNamespace,
        from_position: int,
        sink: ExportSink,
    ) -> None:
        """Prefill ``prompt_token_ids`` without sampling; stream their K/V from ``from_position`` on."""
        if request_id in self._seqs:
            raise RequestRejected(f"request id {request_id!r} is already running")
        if self.kv_cache is None:
            raise RequestRejected("KV export is not supported with tensor or pipeline parallelism")
        prompt = [int(t) for t in prompt_token_ids]
        self.check_request(prompt, SamplingParams(max_tokens=0))
        if not 0 <= from_position < len(prompt):
            raise RequestRejected(
                f"from_position {from_position} is outside the prompt of {len(prompt)} tokens"
            )
        seq = self._sequence(request_id, prompt, SamplingParams(max_tokens=0), namespace)
        self._take_sink(sink)
        seq.export, seq.export_from = sink, from_position
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def take_import_tickets(self) -> list[ImportTicket]:
        """Sequences admitted since the last call that wait for their K/V (the rest of their prompt). One
        whose own prefix cache already covers what it would import gets no ticket: it computes the rest."""
        tickets = []
        for seq in self.scheduler.admitted_importers:
            if seq.status is not SeqStatus.RUNNING or not seq.awaiting_kv:
                continue
            if seq.num_computed >= seq.import_end:
                self._imported(seq, seq.num_computed, seq.num_computed)  # nothing to fetch
                continue
            tickets.append(
                ImportTicket(seq.request_id, list(seq.token_ids), seq.num_computed, seq.import_end,
                             list(seq.block_table), pull=seq.kv_pull)
            )  # fmt: skip
        self.scheduler.admitted_importers.clear()
        return tickets

    def finish_import(self, request_id: str, prefill_cached_tokens: int) -> None:
        """The K/V of every prompt position but the last has arrived: the sequence computes its last prompt
        token itself (so sampling starts from the very generator state a colocated run would have)."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.awaiting_kv or seq.kv_pull:
            return
        # Tokens nobody computed for this request: those the prefill engine found in its own cache.
        self._imported(seq, seq.import_end, prefill_cached_tokens)

    def finish_pull(self, request_id: str, pulled_to: int | None) -> None:
        """A pull from a peer's prefix cache ended. Positions up to ``pulled_to`` hold the peer's K/V (fewer
        than asked when the peer had evicted some); ``None``: the pull failed, and the sequence computes
        everything past its own cached prefix, overwriting whatever the pull had written. Either way the
        request goes on: a pull only ever saves work."""
        seq = self._seqs.get(request_id)
        if seq is None or not seq.awaiting_kv or not seq.kv_pull:
            return
        start = seq.num_computed
        end = start if pulled_to is None else max(start, min(pulled_to, seq.import_end))
        outcome = "failed" if pulled_to is None else "ok" if end == seq.import_end else "partial"
        self.counters.pulled(outcome, end - start)
        # Nobody computed the pulled positions for this request: they count as cached, like its own hits.
        self._imported(seq, end, end)

    def _imported(self, seq: Sequence, computed_to: int, cached_tokens: int) -> None:
        """Positions up to ``computed_to`` now hold K/V: the sequence computes the rest of its prompt."""
        self._transferred[seq.request_id] = computed_to - seq.num_computed
        seq.num_computed = computed_to
        seq.awaiting_kv = False
        seq.num_cached_prompt_tokens = min(cached_tokens, seq.num_prompt_tokens)
        self.blocks.register_full_blocks(seq)

    def export_cached(
        self, prompt_token_ids: Seq[int], namespace: CacheNamespace, from_position: int, sink: ExportSink
    ) -> int:
        """Serve a peer's pull: the K/V of positions ``from_position .. k`` of the prompt, where ``k`` ends
        the longest run of its full blocks in the prefix cache, then the done frame (``tokens`` = ``k``, or
        ``from_position`` when the cache holds no more). Computes nothing and queues nothing, so it never
        waits behind requests. It runs between two steps and holds the run's blocks until the sink's writer
        has sent them (a ``PinnedRun``: a slow peer holds those blocks, never the engine), or, for a sink
        that takes no pinned runs, copies the K/V out before it returns. Either way no later step can evict
        a block before it is sent. The sent blocks nobody uses are then demoted to be evicted first: the
        peer holds them now, so the pull migrates them rather than duplicating them. Returns the positions
        sent."""
        if self.kv_cache is None:
            raise RequestRejected("KV pull is not supported with tensor or pipeline parallelism")
        prompt = [int(t) for t in prompt_token_ids]
        if not 0 <= from_position < len(prompt):
            raise RequestRejected(
                f"from_position {from_position} is outside the prompt of {len(prompt)} tokens"
            )
        probe = self._sequence("kv-pull", prompt, SamplingParams(max_tokens=0), namespace)
        probe.export = sink  # an exporting sequence matches every full block (it has nothing to sample)
        run = self.blocks.match_prefix(probe)
        block_size = self.config.block_size
        end = max(len(run) * block_size, from_position)
        demoted = run[from_position // block_size :]
        if end > from_position:
            self._take_sink(sink)
            if not self._send_pinned(probe, run, from_position, end, demote=demoted):
                send_positions(sink, self.kv_cache, run, from_position, end)
                self.blocks.demote(demoted)
        else:
            self.blocks.demote(demoted)
        sink.close({"t": "done", "tokens": end, "cached_tokens": end})
        self.counters.pull_served(end - from_position)
        return end - from_position

    @cached_property
    def kv_buffers(self) -> HostBuffers:
        """The host buffers this engine stages outgoing K/V in (page-locked for a cache on a GPU)."""
        assert self.kv_cache is not None
        return HostBuffers(pin=self.kv_cache.k[0].is_cuda)

    @cached_property
    def _kv_unpins(self) -> deque[Callable[[], None]]:
        return deque()  # appended from any thread, run on the engine's

    def run_kv_unpins(self) -> None:
        """Give back the blocks of the pinned runs whose transfers are over (on the engine thread: each step
        does, and ``AsyncEngine`` as soon as a sink's ``wake`` asks)."""
        while self._kv_unpins:
            self._kv_unpins.popleft()()

    def _take_sink(self, sink: ExportSink) -> None:
        sink.buffers = sink.buffers or self.kv_buffers
        sink.frame_bytes = self.kv_frame_bytes

    def _send_pinned(self, like: Sequence, run: list[int], start: int, end: int, demote: list[int]) -> bool:
        """Hand ``like.export`` positions ``start .. end`` of the cached blocks ``run`` (the full blocks
        ``like``'s tokens start with) as a PinnedRun: a reference to each block until its writer is done,
        then ``demote`` those blocks. False when the sink takes no pinned runs."""
        sink = like.export
        assert sink is not None and self.kv_cache is not None
        if sink.send_run is None:
            return False
        block_size = self.config.block_size
        pin = Sequence(
            "kv-pin", like.token_ids[: len(run) * block_size], SamplingParams(max_tokens=0), like.hash_seed,
            like.public_seed, like.shared_blocks, export=sink,
        )  # fmt: skip
        self.blocks.allocate(pin)  # matches the very blocks of ``run``: takes a reference to each
        if pin.block_table != run:  # cannot happen between two steps; if it did, copy the K/V out now
            self.blocks.free(pin)
            return False
        wake = sink.wake

        def give_back() -> None:  # on the engine thread
            self.blocks.free(pin)
            self.blocks.demote(demote)

        def unpin() -> None:  # from the writer's thread: the engine thread does the work
            self._kv_unpins.append(give_back)
            if wake is not None:
                wake()

        slots = position_slots(run, block_size, start, end)
        assert sink.buffers is not None
        sink.send_run(
            PinnedRun(
                self.kv_cache, slots, start, frame_bytes=sink.frame_bytes, buffers=sink.buffers, unpin=unpin
            )
        )
        return True

    def _send_cached_exports(self) -> None:
        """Exports whose every position was already cached: send them from the cache, no model step."""
        self.run_kv_unpins()
        for seq in self.scheduler.cached_exports:
            assert seq.export is not None and self.kv_cache is not None
            start, end = max(seq.export_from, seq.export.sent_positions), seq.num_computed
            run = seq.block_table[: end // self.config.block_size]
            if (
                end <= start
                or end % self.config.block_size
                or not self._send_pinned(seq, run, start, end, [])
            ):
                send_cached(seq, self.kv_cache)
            seq.export.sent_positions = end
            self._finish_export(seq)
        self.scheduler.cached_exports.clear()

    def _finish_export(self, seq: Sequence) -> None:
        assert seq.export is not None
        cached = seq.num_cached_prompt_tokens or 0
        self.scheduler.finish(seq, "prefilled")
        seq.export.close({"t": "done", "tokens": seq.num_tokens, "cached_tokens": cached})
        self._forget(seq.request_id)
