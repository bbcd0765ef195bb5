"""The engine's side of K/V transfer, mixed into :class:`~engine.llm_engine.LLMEngine`: prefills that export
their K/V to a decode engine, sequences that import theirs from a prefill engine or pull it from a peer's
prefix cache, and serving a peer's pull from this engine's cache."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from engine.engine_types import ImportTicket, RequestRejected
from engine.kv_export import send_cached, send_positions
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
        waits behind requests; it runs between two steps and copies the K/V out at once, so no later step
        can evict a block before it is sent. The sent blocks nobody uses are then demoted to be evicted
        first: the peer holds them now, so the pull migrates them rather than duplicating them. Returns the
        positions sent."""
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
        if end > from_position:
            send_positions(sink.send, self.kv_cache, run, from_position, end)
        sink.close({"t": "done", "tokens": end, "cached_tokens": end})
        self.blocks.demote(run[from_position // block_size :])
        self.counters.pull_served(end - from_position)
        return end - from_position

    def _send_cached_exports(self) -> None:
        """Exports whose every position was already cached: send them from the cache, no model step."""
        for seq in self.scheduler.cached_exports:
            assert seq.export is not None and self.kv_cache is not None
            send_cached(seq, self.kv_cache)
            self._finish_export(seq)
        self.scheduler.cached_exports.clear()

    def _finish_export(self, seq: Sequence) -> None:
        assert seq.export is not None
        cached = seq.num_cached_prompt_tokens or 0
        self.scheduler.finish(seq, "prefilled")
        seq.export.close({"t": "done", "tokens": seq.num_tokens, "cached_tokens": cached})
        self._forget(seq.request_id)
