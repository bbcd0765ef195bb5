"""What the driver tells the workers each step, and the state the workers keep from step to step.

The workers keep each running sequence's block table (for ``StepMetadata``: a row written only when it
changes) and, on the rank that samples, each sequence's sampler state. So a step sends only what changed:
a whole block table when a sequence is admitted (again), the new blocks when it grew, a sequence's
sampling parameters (and prompt, for penalties) the first time it samples, and the request ids that
finished. ``StepPlanner`` (driver) and ``StageState`` (worker) are the two sides of that protocol.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams, Sequence


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """The tokens of some whole sequences of one step, flattened, as the model takes them."""

    token_ids: list[int]
    seqs: list[tuple[str, int, int]]  # (request id, tokens cached, new tokens): the worker holds its table
    sample_rows: list[int]  # rows whose next-token logits are wanted, in order

    @classmethod
    def of(cls, items: Seq[ScheduledSeq]) -> MicroBatch:
        ids: list[int] = []
        seqs: list[tuple[str, int, int]] = []
        sample_rows: list[int] = []
        for item in items:
            seq, start = item.seq, item.seq.num_computed
            ids.extend(seq.token_ids[start : start + item.num_new])
            seqs.append((seq.request_id, start, item.num_new))
            if item.samples:
                sample_rows.append(len(ids) - 1)
        return cls(ids, seqs, sample_rows)


def split_micro_batches(batch: Seq[ScheduledSeq], n: int, min_tokens: int = 1) -> list[list[ScheduledSeq]]:
    """At most ``n`` non-empty groups of consecutive sequences (fewer when the step has fewer than
    ``n * min_tokens`` tokens), cut where the tokens so far reach the next ``1/n`` of the step's tokens."""
    total = sum(item.num_new for item in batch)
    n = max(1, min(n, len(batch), total // max(1, min_tokens)))
    groups: list[list[ScheduledSeq]] = []
    current: list[ScheduledSeq] = []
    done = 0
    for i, item in enumerate(batch):
        current.append(item)
        done += item.num_new
        items_left, groups_left = len(batch) - i - 1, n - len(groups) - 1
        reached = done * n >= total * (len(groups) + 1)
        if groups_left and items_left >= groups_left and (reached or items_left == groups_left):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True, slots=True)
class TableUpdate:
    request_id: str
    whole: bool  # True: ``blocks`` is the sequence's whole (new) table; False: blocks appended to it
    blocks: list[int]


@dataclass(frozen=True, slots=True)
class SampleRow:
    """One sampling row: ``params`` (and ``prompt``, for a penalised request) the first time it samples."""

    request_id: str
    num_output_tokens: int
    params: SamplingParams | None = None
    prompt: list[int] | None = None


@dataclass(frozen=True, slots=True)
class StepPlan:
    micro_batches: list[MicroBatch]
    tables: list[TableUpdate]
    sampling: list[SampleRow]  # in batch order: the rows of every micro-batch's ``sample_rows``
    forget: list[str]  # finished requests: applied before anything else in the plan
    eos_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _Sent:
    seq: Sequence
    blocks: list[int]  # the block list last sent: a different list is a new admission
    num_blocks: int
    sampled: bool = False


class StepPlanner:
    """The driver's record of what the workers hold; ``plan`` says what one step must add to it."""

    def __init__(self, num_micro_batches: int = 1, min_micro_batch_tokens: int = 1) -> None:
        self.num_micro_batches = num_micro_batches
        self.min_micro_batch_tokens = min_micro_batch_tokens
        self._sent: dict[str, _Sent] = {}

    def plan(self, batch: Seq[ScheduledSeq], eos_token_ids: Iterable[int] = ()) -> StepPlan:
        forget = [rid for rid, sent in self._sent.items() if sent.seq.finished]
        for rid in forget:
            del self._sent[rid]
        tables: list[TableUpdate] = []
        sampling: list[SampleRow] = []
        for item in batch:
            seq, rid = item.seq, item.seq.request_id
            sent = self._sent.get(rid)
            if sent is not None and sent.seq is not seq:  # the id of a request that finished unseen
                forget.append(rid)
                sent = None
            if sent is None:
                sent = self._sent[rid] = _Sent(seq, seq.block_table, 0)
            blocks = seq.block_table
            if sent.blocks is not blocks or len(blocks) < sent.num_blocks or not sent.num_blocks:
                tables.append(TableUpdate(rid, True, list(blocks)))
            elif len(blocks) > sent.num_blocks:
                tables.append(TableUpdate(rid, False, blocks[sent.num_blocks :]))
            sent.blocks, sent.num_blocks = blocks, len(blocks)
            if item.samples:
                params = prompt = None
                if not sent.sampled:
                    params = seq.params
                    prompt = seq.token_ids[: seq.num_prompt_tokens] if params.penalized else None
                    sent.sampled = True
                sampling.append(SampleRow(rid, seq.num_output_tokens, params, prompt))
        groups = split_micro_batches(batch, self.num_micro_batches, self.min_micro_batch_tokens)
        micro_batches = [MicroBatch.of(g) for g in groups]
        return StepPlan(micro_batches, tables, sampling, forget, tuple(eos_token_ids))


@dataclass(slots=True)
class BlockList:
    """A worker's copy of one sequence's block table; ``StepMetadata`` keys its row by this object."""

    blocks: list[int]


@dataclass(slots=True)
class SamplingSeq:
    """A worker's view of one sequence, as much as ``Sampler`` reads of it."""

    request_id: str
    params: SamplingParams
    token_ids: list[int]  # the prompt (penalised requests only)
    num_prompt_tokens: int
    num_output_tokens: int = 0


@dataclass
class StageState:
    """The worker's side: every running sequence's block table, and the sampling rows' sequences."""

    tables: dict[str, BlockList] = field(default_factory=dict)
    sampling: dict[str, SamplingSeq] = field(default_factory=dict)

    def apply(self, plan: StepPlan) -> list[BlockList]:
        """Bring the state up to ``plan``; returns the tables of the requests it forgot (rows to free)."""
        dropped: list[BlockList] = []
        for rid in plan.forget:
            table = self.tables.pop(rid, None)
            if table is not None:
                dropped.append(table)
            self.sampling.pop(rid, None)
        for update in plan.tables:
            table = self.tables.get(update.request_id)
            if table is None:
                self.tables[update.request_id] = BlockList(update.blocks)
            elif update.whole:
                table.blocks = update.blocks  # a new list: StepMetadata rewrites the sequence's row
            else:
                self.tables[update.request_id].blocks.extend(update.blocks)
        for row in plan.sampling:
            seq = self.sampling.get(row.request_id)
            if seq is None:
                assert row.params is not None, f"{row.request_id}: sampled before its parameters were sent"
                prompt = row.prompt or []
                seq = self.sampling[row.request_id] = SamplingSeq(
                    row.request_id, row.params, prompt, len(prompt)
                )
            seq.num_output_tokens = row.num_output_tokens
        return dropped

    def step_seqs(self, mb: MicroBatch) -> list[tuple[object, list[int], int, int]]:
        """``StepMetadata.build``'s input for one micro-batch."""
        out: list[tuple[object, list[int], int, int]] = []
        for rid, num_computed, num_new in mb.seqs:
            table = self.tables[rid]
            out.append((table, table.blocks, num_computed, num_new))
        return out

    def sampling_seqs(self, plan: StepPlan) -> list[SamplingSeq]:
        return [self.sampling[row.request_id] for row in plan.sampling]
