"""What the driver sends the tp x pp workers each step: only what changed since the last one, and the
workers' copy of the block tables and sampling rows kept in step with the driver's."""

from __future__ import annotations

import numpy as np

from engine.parallel.step_plan import StageState, StepPlan, StepPlanner, TableUpdate
from engine.scheduler import ScheduledSeq
from engine.sequence import SamplingParams, SeqStatus, Sequence
from engine.step_metadata import StepMetadata

PLAIN = SamplingParams(seed=1)
PENALISED = SamplingParams(seed=2, repetition_penalty=1.2)


def step(planner: StepPlanner, state: StageState, meta: StepMetadata, *items: ScheduledSeq) -> StepPlan:
    plan = planner.plan(list(items), eos_token_ids=[2])
    for table in state.apply(plan):
        meta.release(table)
    for mb in plan.micro_batches:  # the worker's tables give the block rows the driver's lists give
        built, _, _ = meta.build(state.step_seqs(mb), np.asarray(mb.token_ids))
        expected = [list(item.seq.block_table) for item in items]
        assert [list(s.block_table) for s in built.slices] == expected
    return plan


def test_a_step_sends_each_block_table_once_then_only_its_new_blocks() -> None:
    planner, state, meta = StepPlanner(), StageState(), StepMetadata(4)
    a = Sequence("a", [1, 2, 3, 4, 5], PLAIN, 0, block_table=[7, 8])
    b = Sequence("b", [6, 7, 8], PENALISED, 0, block_table=[3])
    first = step(planner, state, meta, ScheduledSeq(a, 5, True), ScheduledSeq(b, 3, True))
    assert first.tables == [TableUpdate("a", True, [7, 8]), TableUpdate("b", True, [3])]
    assert [(r.request_id, r.params, r.prompt) for r in first.sampling] == [
        ("a", PLAIN, None),
        ("b", PENALISED, [6, 7, 8]),  # the penalty counts start from the prompt
    ]
    assert first.eos_token_ids == (2,)
    for seq, token in ((a, 9), (b, 10)):
        seq.num_computed = seq.num_tokens
        seq.token_ids.append(token)

    decode = step(planner, state, meta, ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True))
    assert decode.tables == [] and decode.forget == []  # nothing changed: nothing sent
    assert [(r.request_id, r.num_output_tokens, r.params, r.prompt) for r in decode.sampling] == [
        ("a", 1, None, None),
        ("b", 1, None, None),
    ]
    assert state.sampling["b"].num_output_tokens == 1 and state.sampling["b"].token_ids == [6, 7, 8]

    a.num_computed, b.num_computed = a.num_tokens, b.num_tokens
    a.token_ids.append(11)
    b.token_ids.append(12)
    b.block_table.append(5)  # grew: only the new block goes
    grown = step(planner, state, meta, ScheduledSeq(a, 1, True), ScheduledSeq(b, 1, True))
    assert grown.tables == [TableUpdate("b", False, [5])]
    assert state.tables["b"].blocks == [3, 5]

    a.block_table = [9, 10]  # preempted and admitted again: a new list, sent whole
    a.num_computed = 0
    again = step(planner, state, meta, ScheduledSeq(a, a.num_tokens, True))
    assert again.tables == [TableUpdate("a", True, [9, 10])]

    b.status = SeqStatus.FINISHED
    c = Sequence("b", [4, 4], PLAIN, 0, block_table=[11])  # a new request reusing a finished one's id
    last = step(planner, state, meta, ScheduledSeq(c, 2, True))
    assert last.forget == ["b"]
    assert last.tables == [TableUpdate("b", True, [11])]
    assert last.sampling[0].params == PLAIN and state.sampling["b"].params == PLAIN
