"""Simulated engines that run ``perfmodel``'s batching cost model (``kvgate simulate --profile``).

The default simulated engine (``simulator.SimEngine``) is a FIFO prefill server plus a fixed decode time per
output token. A ``BatchedSimEngine`` keeps everything else of it (the LRU of trace blocks, the KV events, the
pulls over a peer's outbound link) but serves through a ``perfmodel.batching.BatchingEngine`` under an
``EngineProfile``: continuous batching with chunked prefill, FIFO admission under a token budget and the KV
capacity, step times from ``perfmodel.batching.step_time_s``, the one formula the simulated engine
(``engine/sim``) uses too.

A request is submitted at its arrival (or when its pulled prefix has arrived, if later) with its prompt, the
prompt tokens it finds cached (its LRU hit in trace blocks, local and pulled, in tokens) and its output
tokens. The replay advances every engine's model to each arrival before routing, so the load the router
reads (waiting, running, queued prefill tokens) is the model's, and runs them all to completion at the end;
a request's first token is then the model's ``first_token_s``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from perfmodel.batching import BatchingEngine, StepRecord
from perfmodel.profiles import EngineProfile
from region_map.simulation.simulator import CostModel, SimEngine
from region_map.simulation.trace import TraceRequest

StepHook = Callable[[str, StepRecord], None]
"""Called with an engine's id and each step it executes, in the engine's order (tests, traces)."""


class BatchedSimEngine(SimEngine):
    """A ``SimEngine`` whose prefill and decode are ``perfmodel``'s batching model under ``profile``.

    ``cost`` still gives the trace's block size, the round trip between regions and the pull link.
    """

    def __init__(
        self,
        engine_id: str,
        region: str,
        capacity_blocks: int,
        cost: CostModel,
        on_change: Callable[[str, list[int], list[int]], None],
        profile: EngineProfile,
        on_step: StepHook | None = None,
    ) -> None:
        super().__init__(engine_id, region, capacity_blocks, cost, on_change)
        self.batching = BatchingEngine(profile)
        self._on_step = on_step
        self._last_submit = float("-inf")
        self._computing: dict[str, list[int]] = {}  # request key -> the blocks its prefill computes
        self.on_first_token: Callable[[str, float], None] | None = None  # (key, when): its prefill is done

    def advance(self, now: float) -> None:
        """Execute every step that ends by ``now`` (call it with each arrival, in order)."""
        self._report(self.batching.run_until(now))

    def finish(self) -> None:
        """Execute steps until every submitted request has finished."""
        self._report(self.batching.run_to_completion())

    def _report(self, steps: list[StepRecord]) -> None:
        computing, ready_at = self._computing, self._ready_at
        for record in steps:
            for key in record.first_tokens:  # its prefill has run: its blocks can be pulled from now on
                for b in computing.pop(key, ()):
                    ready_at.pop(b, None)
                if self.on_first_token is not None:
                    self.on_first_token(key, record.end_s)
            if self._on_step is not None:
                self._on_step(self.id, record)

    # The load a health poll would report, as of the last ``advance``.
    def in_flight(self, now: float) -> int:
        return self.batching.running + self.batching.waiting

    def waiting(self, now: float) -> int:
        return self.batching.waiting

    def queued_prefill_tokens(self, now: float) -> int:
        return self.batching.queued_prefill_tokens

    def room(self, now: float) -> tuple[int, int] | None:
        profile = self.batching.profile
        return profile.max_running, profile.kv_capacity_tokens - self.batching.kv_used_tokens

    def submit(self, key: str, now: float, request: TraceRequest, source: SimEngine | None = None) -> int:
        """Admit ``request`` (arriving at ``now``) under ``key``, pulling from ``source`` the leading blocks
        it holds beyond this engine's own; returns the prompt blocks not computed here (local and pulled)."""
        self.requests += 1
        ready, hit = self._find_prefix(now, request, source)
        prompt = max(1, request.input_tokens)
        cached = min(hit * self.cost.block_tokens, prompt)
        # FIFO: a request queued behind one still waiting for its pull cannot start before it anyway, so
        # holding arrivals non-decreasing (as the model requires) changes no admission.
        at = max(ready, self._last_submit)
        self.batching.submit(key, at, prompt, cached, max(1, request.output_tokens))
        self._last_submit = at
        stored = self._store(request, math.inf)  # (when is known once its prefill's step has run)
        if stored:
            self._computing[key] = stored
        return hit

    def first_token_s(self, key: str) -> float:
        """When the request submitted under ``key`` got its first token (after ``finish``); forgets it."""
        first = self.batching.forget(key).first_token_s
        assert first is not None  # a finished request has had its first token
        return first

    def serve(self, now: float, request: TraceRequest, source: SimEngine | None = None) -> tuple[float, int]:
        raise TypeError("a BatchedSimEngine's first token is known only later: use submit and first_token_s")
