"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step has a token budget. Running sequences go first, in admission order: a decoding sequence takes
one token, a sequence still prefilling takes as much of its prompt as the budget allows (chunked prefill).
Then waiting sequences are admitted, first come first served, sharing their cached prefix (the block manager
remembers the match of a sequence that has to wait, so it is not walked again every step). The load it
reports counts the prompt tokens still to compute: the waiting sequences' past the prefix cached when they
were queued, and the running ones' still to prefill (a router reads them as the prefill queued here, so a
waiting turn whose prefix is cached must not count as a whole prompt). When a running
sequence needs a block and none is free, the most recently admitted sequence is preempted: its blocks are
released and it waits again, to be recomputed (cheaply, when its blocks are still in the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed for it in this step, from seq.num_computed on
    samples: bool  # the step reaches the end of its known tokens, so it yields a new one

    @classmethod
    def of(cls, seq: Sequence, num_new: int) -> ScheduledSeq:
        return cls(seq, num_new, seq.num_computed + num_new == seq.num_tokens and seq.export is None)


class Scheduler:
    def __init__(
        self, blocks: BlockManager, *, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._waiting_prefill = 0  # the waiting sequences' queued_prefill, summed
        self.preemptions = 0
        self.admitted_importers: list[Sequence] = []  # given blocks this step; their K/V is to be fetched
        self.cached_exports: list[
            Sequence
        ] = []  # admitted exports whose every token was cached: send, no step

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)
        self._queued(seq)

    def _queued(self, seq: Sequence) -> None:
        # (The match is the one admission uses: the block manager remembers it for can_allocate.)
        seq.queued_prefill = max(0, seq.num_tokens - self.blocks.cached_prefix_tokens(seq))
        self._waiting_prefill += seq.queued_prefill

    def _dequeued(self, seq: Sequence) -> None:
        self._waiting_prefill -= seq.queued_prefill
        seq.queued_prefill = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens still to compute: the waiting sequences' past their cached prefix, and the running
        ones' not computed yet (a chunked prefill's rest)."""
        prefilling = sum(
            s.num_prompt_tokens - s.num_computed for s in self.running if s.num_computed < s.num_prompt_tokens
        )
        return self._waiting_prefill + prefilling

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted_before = self.preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.awaiting_kv:
                i += 1  # holds its blocks; nothing to compute until its K/V has arrived
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.blocks.can_grow(seq, seq.num_computed + n):
                victim = next((s for s in reversed(self.running) if not s.awaiting_kv), seq)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue  # it preempted itself; the same index now holds the next sequence (or none)
            self.blocks.grow(seq, seq.num_computed + n)
            scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
            i += 1
        # After a preemption, admitting newcomers would only take the blocks the victim needs back.
        admit = self.preemptions == preempted_before
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self._dequeued(seq)
            cached = self.blocks.allocate(seq)
            if seq.num_cached_prompt_tokens is None:
                seq.num_cached_prompt_tokens = min(cached, seq.num_prompt_tokens)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.awaiting_kv:
                self.admitted_importers.append(seq)
                continue
            if seq.num_computed == seq.num_tokens:
                self.cached_exports.append(seq)
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            scheduled.append(ScheduledSeq.of(seq, n))
            budget -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self._queued(seq)
        self.preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished, or aborted by its client) and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.free(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
            self._dequeued(seq)
            self.blocks.forget(seq)  # the prefix match can_allocate remembered for it
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
