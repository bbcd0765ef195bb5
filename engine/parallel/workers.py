"""The worker process of one rank: join the group, load this rank's shard, then run each step it is sent.

The driver (``engine.parallel.executor``) talks to each worker over a pipe: it sends the pickled step plan
(``engine.parallel.step_plan.StepPlan``), the worker answers ``("ok", SamplerOutput or None)`` (the tokens
the last stage's first tensor-parallel rank sampled) or ``("error", kind, message)``, after which it computes
nothing more and waits to be stopped. A closed pipe (the driver is gone) or a ``None`` plan ends the worker.
"""

from __future__ import annotations

import contextlib
import pickle
import signal
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.attention import KVCache
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.parallel.distributed import ParallelConfig, join_world, placement_for
from engine.parallel.layers import kv_head_rows
from engine.parallel.pipeline import PipelineStage

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one rank needs; picklable, so that a spawned process can receive it."""

    model_dir: str
    parallel: ParallelConfig
    rank: int
    init_method: str  # file://path of the rendezvous store (one node)
    device: str  # "cpu" or "cuda:N"
    dtype: str  # a key of _DTYPES
    num_blocks: int
    block_size: int
    timeout_s: float
    threads: int
    max_num_seqs: int = 64  # sizes the block table (it grows if a step needs more)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The process's entry point (forked by the executor's fork server)."""
    # Ctrl-C reaches the whole process group: the driver handles it and stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stage = _start(spec)
    except Exception as exc:
        _send(conn, ("error", type(exc).__name__, str(exc) or traceback.format_exc(limit=3)))
        return
    _send(conn, ("ready", spec.rank))
    try:
        _serve(stage, conn)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start(spec: WorkerSpec) -> PipelineStage:
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    device = torch.device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    config = ModelConfig.from_dir(spec.model_dir)
    group = join_world(spec.parallel, spec.rank, spec.init_method, device, spec.timeout_s)
    placement = placement_for(config, spec.parallel, spec.rank, group)
    dtype = _DTYPES[spec.dtype]
    model, _ = load_model(spec.model_dir, dtype=dtype, device=device, placement=placement)
    tp = placement.tp
    kv_heads = len(kv_head_rows(config.num_key_value_heads, 1, tp)) if tp.enabled else None
    kv_heads = kv_heads or config.num_key_value_heads
    kv_cache = KVCache(
        len(placement.layers), spec.num_blocks, spec.block_size, kv_heads, config.head_dim, dtype, device
    )
    return PipelineStage(model, kv_cache, placement, spec.parallel, device, spec.max_num_seqs)


def _serve(stage: PipelineStage, conn: Connection) -> None:
    failed = False
    while True:
        try:
            plan = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the driver is gone
        if plan is None:
            return
        if failed:
            continue  # the driver stops a failed engine; exiting first would only blur which rank failed
        try:
            sampled = stage.run(plan)
        except Exception as exc:  # a peer died mid-collective, or the step itself failed
            _send(conn, ("error", type(exc).__name__, f"{exc}"))
            failed = True
            continue
        _send(conn, ("ok", sampled))


def _send(conn: Connection, message: tuple[object, ...]) -> None:
    with contextlib.suppress(OSError):  # the driver is gone; nobody is left to tell
        conn.send(message)
