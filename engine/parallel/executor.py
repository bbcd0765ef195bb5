"""The driver's side of a tp x pp engine: spawns one worker process per rank, sends each step to all of them,
returns the tokens the last stage sampled, and notices a rank that died.

The scheduler runs once, here, so block tables are the same on every rank. A watchdog thread waits on the
workers' process sentinels: the moment one exits, ``failure`` is set and the other workers are stopped (they
would otherwise wait on their dead peer until the collective timeout). A step in progress notices the same
sentinel and raises ``RankFailed``; so does every later step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import torch

from engine.model.errors import ModelLoadError
from engine.parallel.distributed import ParallelConfig, ParallelConfigError
from engine.parallel.step_plan import StepPlanner
from engine.parallel.workers import WorkerSpec, worker_main
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledSeq

log = logging.getLogger("kvgate.engine.parallel")

_LOAD_ERRORS: dict[str, type[Exception]] = {
    "ModelLoadError": ModelLoadError,
    "ParallelConfigError": ParallelConfigError,
}


class RankFailed(RuntimeError):
    """A worker rank died, failed a step or stopped answering: the engine can compute nothing more."""


class ParallelExecutor:
    """Runs steps on ``tp * pp`` worker processes; the same ``execute`` as ``ModelRunner``, but the last
    stage samples (with a ``Sampler`` of its own): only token ids come back."""

    def __init__(
        self,
        model_dir: str,
        parallel: ParallelConfig,
        *,
        device: torch.device,
        dtype: str,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
        timeout_s: float = 120.0,
        startup_timeout_s: float = 600.0,
        min_micro_batch_tokens: int = 64,
        max_num_seqs: int = 64,
    ) -> None:
        world = parallel.world_size
        if device.type == "cuda" and torch.cuda.device_count() < world:
            raise ParallelConfigError(
                f"--tp x --pp = {world} ranks need {world} GPUs; {torch.cuda.device_count()} are visible"
            )
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.failure: RankFailed | None = None
        self.steps = 0
        self.micro_batches = 0
        self._lock = threading.Lock()
        self._stop_lock = threading.Lock()  # the watchdog and the engine thread may both stop the workers
        self._closing = False
        self._output_rank = parallel.rank(parallel.pipeline_parallel_size - 1, 0)
        # One micro-batch per stage keeps every stage busy once the pipeline is full; 1 turns overlap off.
        self.planner = StepPlanner(parallel.pipeline_parallel_size, min_micro_batch_tokens)
        # Fork would copy the driver's threads and CUDA state; spawn would import torch again in every
        # worker (seconds of CPU each). A fork server imports it once and forks clean workers from itself.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["engine.parallel.workers"])
        # A file store: no port to pick and lose to another process before the ranks bind it.
        fd, self._rendezvous = tempfile.mkstemp(prefix="kvgate-rendezvous-")
        os.close(fd)
        init_method = f"file://{self._rendezvous}"
        threads = max(1, (os.cpu_count() or 1) // world)
        self.processes: list[BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            spec = WorkerSpec(
                model_dir=model_dir,
                parallel=parallel,
                rank=rank,
                init_method=init_method,
                device=f"cuda:{rank}" if device.type == "cuda" else "cpu",
                dtype=dtype,
                num_blocks=num_blocks,
                block_size=block_size,
                timeout_s=timeout_s,
                threads=threads,
                max_num_seqs=max_num_seqs,
            )
            process = ctx.Process(
                target=worker_main, args=(spec, theirs), name=f"kvgate-rank{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self.processes.append(process)
            self._conns.append(ours)
        try:
            self._collect(startup_timeout_s, starting=True)
        except BaseException:
            self.close()
            raise
        self._watchdog = threading.Thread(target=self._watch, name="kvgate-rank-watchdog", daemon=True)
        self._watchdog.start()

    # -- steps ------------------------------------------------------------------------------------------

    @property
    def min_micro_batch_tokens(self) -> int:
        return self.planner.min_micro_batch_tokens

    @min_micro_batch_tokens.setter
    def min_micro_batch_tokens(self, value: int) -> None:
        self.planner.min_micro_batch_tokens = value

    def execute(
        self, batch: list[ScheduledSeq], sampler: Sampler | None = None, eos_token_ids: Iterable[int] = ()
    ) -> SamplerOutput | None:
        """Compute every scheduled token on the ranks and sample the entries that sample, in batch order
        (None when none does). ``sampler`` is the driver's and goes unused: the last stage keeps its own.
        Raises RankFailed (and stops every worker) if any rank fails."""
        if self.failure is not None:
            raise self.failure
        plan = self.planner.plan(batch, eos_token_ids)
        payload = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as exc:
                self._fail(f"rank {self._describe(rank)} cannot be reached: {exc}")
        replies = self._collect(self.timeout_s)
        self.steps += 1
        self.micro_batches += len(plan.micro_batches)
        sampled: SamplerOutput | None = replies[self._output_rank]
        return sampled if plan.sampling else None

    def _collect(self, timeout_s: float, *, starting: bool = False) -> dict[int, Any]:
        """Each rank's answer; raises as soon as one rank errs or dies, or when time runs out."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        by_conn = {conn: rank for rank, conn in enumerate(self._conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self.processes)}
        while len(replies) < len(self._conns):
            waiting = [c for c, r in by_conn.items() if r not in replies]
            ready = wait([*waiting, *by_sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                silent = sorted(set(by_conn.values()) - set(replies))
                self._fail(f"no answer from ranks {silent} in {timeout_s:g} s")
            # Answers first: a rank that reported an error and then exited says why it failed.
            for conn in (item for item in ready if isinstance(item, Connection)):
                rank = by_conn[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    self._fail(self._death(rank))
                if message[0] == "error":
                    kind, text = message[1], message[2]
                    if starting and kind in _LOAD_ERRORS:
                        self._fail(text, _LOAD_ERRORS[kind])
                    dead = [self._death(r) for r in self._dead_peers(rank)]
                    self._fail("; ".join([*dead, f"rank {self._describe(rank)} failed: {kind}: {text}"]))
                replies[rank] = message[1]
            for sentinel in (item for item in ready if isinstance(item, int)):
                rank = by_sentinel[sentinel]
                if rank not in replies:
                    self._fail(self._death(rank))
        return replies

    # -- failure ----------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._closing:
            dead = wait([p.sentinel for p in self.processes], timeout=0.5)
            if dead and not self._closing:
                rank = next(r for r, p in enumerate(self.processes) if p.sentinel in dead)
                with self._lock:
                    if self.failure is None:
                        self.failure = RankFailed(self._death(rank))
                log.error("%s", self.failure)
                self._stop_workers()
                return

    def _fail(self, why: str, kind: type[Exception] = RankFailed) -> NoReturn:
        error = kind(why)
        with self._lock:
            if isinstance(error, RankFailed):
                # The watchdog may have seen the first death already and stopped the others since: the
                # first death is the news, not a survivor it terminated.
                if self.failure is None:
                    self.failure = error
                error = self.failure
        self._stop_workers()
        raise error

    def _dead_peers(self, rank: int, grace_s: float = 1.0) -> list[int]:
        """Ranks other than ``rank`` that have exited, waiting ``grace_s`` for one to. A peer's death usually
        reaches a survivor as a collective error (connection reset) a moment before the dead process can
        be reaped: the dead rank is the news, not the survivor's error."""
        others = {p.sentinel: r for r, p in enumerate(self.processes) if r != rank}
        wait(list(others), timeout=grace_s)
        return [r for r, p in enumerate(self.processes) if r != rank and not p.is_alive()]

    def _death(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(0.1)
        return f"rank {self._describe(rank)} died (exit code {process.exitcode})"

    def _describe(self, rank: int) -> str:
        stage, tp_rank = self.parallel.place(rank)
        return f"{rank} (pipeline stage {stage}, tensor-parallel rank {tp_rank})"

    # -- shutdown ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every worker (asking first, then terminating); safe to call more than once."""
        self._closing = True
        for conn in self._conns:
            with contextlib.suppress(OSError):  # already gone
                conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + 5.0
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        self._stop_workers()
        for conn in self._conns:
            conn.close()
        with contextlib.suppress(OSError):  # the store removes it itself once every rank let go of it
            os.unlink(self._rendezvous)

    def _stop_workers(self) -> None:
        with self._stop_lock:
            for process in self.processes:
                if process.is_alive():
                    process.terminate()  # a survivor may be blocked in a collective with the dead rank
            for process in self.processes:
                process.join(2.0)
                if process.is_alive():
                    process.kill()
                    process.join(2.0)
