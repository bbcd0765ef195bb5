"""The prefill engine's side of a KV transfer: which K/V of a step goes out, and when.

During a step the model runner calls ``on_layer(i)`` after layer ``i`` stored its K/V; every exporting
sequence in the batch then sends that layer for the positions this step computed (and, on its first step,
the positions its own prefix cache already held). Sinks are called on the engine thread and must not block.
A KV pull from a peer sends cached positions only, with ``send_positions``, between two steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention import KVCache
from engine.kv_transfer import kv_frame, position_slots
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence


@dataclass
class ExportSink:
    """Where one sequence's frames go (``send`` takes a frame's buffers; ``close`` the final header)."""

    send: Callable[[list[Any]], None]
    close: Callable[[dict[str, Any]], None]
    sent_positions: int = 0
    layers_sent: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Plan:
    sink: ExportSink
    start: int
    slots: torch.Tensor


def plan_exports(batch: list[ScheduledSeq], block_size: int) -> list[_Plan]:
    """For each exporting sequence: the positions whose K/V leave after each layer of this step."""
    plans = []
    for item in batch:
        seq = item.seq
        if seq.export is None:
            continue
        end = seq.num_computed + item.num_new
        start = max(seq.export_from, seq.export.sent_positions)
        if end > start:
            plans.append(_Plan(seq.export, start, position_slots(seq.block_table, block_size, start, end)))
            seq.export.sent_positions = end
    return plans


def layer_sender(plans: list[_Plan], kv_cache: KVCache) -> Callable[[int], None]:
    def on_layer(i: int) -> None:
        k_cache, v_cache = kv_cache.layer(i)
        for plan in plans:
            # Indexing copies the slots out: the cache may change as soon as the step moves on.
            plan.sink.send(kv_frame(i, plan.start, k_cache[plan.slots].cpu(), v_cache[plan.slots].cpu()))

    return on_layer


def send_cached(seq: Sequence, kv_cache: KVCache) -> None:
    """Every layer of positions ``export_from`` on, straight from the cache (nothing left to compute)."""
    assert seq.export is not None
    start, end = max(seq.export_from, seq.export.sent_positions), seq.num_computed
    if end <= start:
        return
    send_positions(seq.export.send, kv_cache, seq.block_table, start, end)
    seq.export.sent_positions = end


def send_positions(
    send: Callable[[list[Any]], None], kv_cache: KVCache, block_table: list[int], start: int, end: int
) -> None:
    """Every layer of positions ``start .. end`` of the blocks ``block_table``, one frame per layer. Indexing
    copies the K/V out now, on the engine thread: the blocks may be reused as soon as the engine steps on."""
    slots = position_slots(block_table, kv_cache.block_size, start, end)
    for i in range(len(kv_cache.k)):
        k_cache, v_cache = kv_cache.layer(i)
        send(kv_frame(i, start, k_cache[slots].cpu(), v_cache[slots].cpu()))
