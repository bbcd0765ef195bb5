"""A deterministic discrete-time model of one batching engine: FIFO admission, chunked prefill, step times.

Each step, in order:

1. Admission, strictly FIFO (no request overtakes the head of the queue): waiting requests that have
   arrived by the step's start are admitted while fewer than ``max_running`` run, token budget is left
   (see 2) and the KV cache has room
   for the request's whole reservation (``kv_tokens_needed``: prompt + output tokens, rounded up to whole
   blocks; reserved at admission, freed at finish, never preempted; cached prefix tokens are reserved too,
   a conservative simplification of shared prefix blocks).
2. Scheduling under the token budget ``max_batch_tokens``, as vLLM's chunked prefill does: every running
   sequence in its decode phase takes one token of the budget first, then sequences still prefilling take
   chunks of what remains, in admission order, then newly admitted requests (step 1 happens here: a
   request is admitted only if some budget is left for its first chunk, so a backlog shows in ``waiting``).
   A request computes ``max(1, prompt - cached)`` prefill tokens (an engine always recomputes at least the
   last prompt token) and reads its ``cached`` tokens' KV once, in the step of its first chunk.
3. The step lasts ``step_time_s`` of that batch. At its end a request whose prefill completed has its first
   token (``first_token_s``; prefill emits the first output token), and each decode sequence one more; a
   request with all ``output_tokens`` (the first included) finishes (``finish_s``) and frees its KV.

A step costs O(running) work (admission is amortised O(1) per request). The same inputs give the same
steps, bit for bit: the model is pure arithmetic on floats in a fixed order.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from perfmodel.profiles import EngineProfile


def step_time_s(
    profile: EngineProfile, prefill_tokens: int, decode_seqs: int, cached_tokens_read: int = 0
) -> float:
    """The duration of one engine step with this batch (the one formula every caller shares)."""
    return (
        profile.step_fixed_s
        + profile.prefill_s_per_token * prefill_tokens
        + profile.decode_s_per_seq * decode_seqs
        + profile.cached_read_s_per_token * cached_tokens_read
    )


def kv_tokens_needed(profile: EngineProfile, prompt_tokens: int, output_tokens: int) -> int:
    """The KV cache a request reserves at admission: prompt + output tokens, rounded up to whole blocks."""
    block = profile.block_size
    return -(-(prompt_tokens + output_tokens) // block) * block


def prefill_throughput_tokens_per_s(profile: EngineProfile, decode_seqs: int = 0) -> float:
    """Prefill tokens/s in steady state with every step full: the budget left after ``decode_seqs`` decodes,
    divided by that step's time (the rate above which arrivals of prefill work must queue)."""
    prefill = max(0, profile.max_batch_tokens - decode_seqs)
    return prefill / step_time_s(profile, prefill, min(decode_seqs, profile.max_batch_tokens))


@dataclass(frozen=True)
class RequestResult:
    """What the model says of one request so far: ``None`` for what has not happened yet."""

    request_id: str
    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finish_s: float | None


@dataclass(frozen=True)
class StepRecord:
    """One executed step: its batch, its interval, and the requests that got their first token or finished."""

    start_s: float
    end_s: float
    duration_s: float  # exactly ``step_time_s`` of the batch (``end_s - start_s`` up to rounding)
    prefill_tokens: int
    decode_seqs: int
    cached_tokens_read: int
    admitted: tuple[str, ...]
    first_tokens: tuple[str, ...]
    finished: tuple[str, ...]


class _Request:
    """A request's mutable state inside the engine."""

    __slots__ = (
        "admitted_s",
        "arrival_s",
        "cached_tokens",
        "cached_unread",
        "decoded",
        "finish_s",
        "first_token_s",
        "kv_tokens",
        "output_tokens",
        "prefill_left",
        "request_id",
    )

    def __init__(
        self, request_id: str, arrival_s: float, cached_tokens: int, prefill: int, output: int, kv: int
    ) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.cached_tokens = cached_tokens
        self.cached_unread = cached_tokens
        self.prefill_left = prefill
        self.output_tokens = output
        self.decoded = 0  # output tokens emitted so far (the first one by the prefill)
        self.kv_tokens = kv
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None

    def result(self) -> RequestResult:
        return RequestResult(
            self.request_id, self.arrival_s, self.admitted_s, self.first_token_s, self.finish_s
        )


@dataclass(frozen=True)
class _Plan:
    """The next step, computed without changing the engine."""

    start_s: float
    admit: int  # how many waiting requests (from the head) are admitted
    decodes: tuple[_Request, ...]
    chunks: tuple[tuple[_Request, int], ...]
    cached_read: int
    duration_s: float


class BatchingEngine:
    """One engine's step loop under an ``EngineProfile``; see the module docstring for the rules.

    Feed it with ``submit`` in arrival order, advance it with ``step``/``run_until``/``run_to_completion``,
    read its load from ``waiting``, ``running``, ``queued_prefill_tokens`` and ``kv_used_tokens``, and each
    request's times from ``result``.
    """

    def __init__(self, profile: EngineProfile, start_s: float = 0.0) -> None:
        self.profile = profile
        self._now = start_s
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # admission order
        self._requests: dict[str, _Request] = {}
        self._kv_used = 0
        self._queued_prefill = 0
        self._last_arrival = float("-inf")

    # ---- input -------------------------------------------------------------------------------------------

    def submit(
        self, request_id: str, arrival_s: float, prompt_tokens: int, cached_tokens: int, output_tokens: int
    ) -> None:
        """Queue a request (FIFO). Arrivals must not decrease; a request that could never fit the KV cache,
        a duplicate id or nonsensical counts raise ``ValueError``."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} was already submitted")
        if arrival_s < self._last_arrival:
            raise ValueError(f"arrivals must not decrease: {arrival_s} after {self._last_arrival}")
        if prompt_tokens < 1 or output_tokens < 1 or not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(
                f"request {request_id!r}: need prompt_tokens >= 1, output_tokens >= 1 and "
                f"0 <= cached_tokens <= prompt_tokens (got {prompt_tokens}, {output_tokens}, {cached_tokens})"
            )
        kv = kv_tokens_needed(self.profile, prompt_tokens, output_tokens)
        if kv > self.profile.kv_capacity_tokens:
            raise ValueError(
                f"request {request_id!r} needs {kv} KV tokens, more than the engine's "
                f"{self.profile.kv_capacity_tokens}"
            )
        prefill = max(1, prompt_tokens - cached_tokens)
        req = _Request(request_id, arrival_s, cached_tokens, prefill, output_tokens, kv)
        self._requests[request_id] = req
        self._waiting.append(req)
        self._queued_prefill += prefill
        self._last_arrival = arrival_s

    # ---- state -------------------------------------------------------------------------------------------

    @property
    def now_s(self) -> float:
        """The end of the last executed step (or the start time): the engine is busy until then."""
        return self._now

    @property
    def waiting(self) -> int:
        """Submitted requests not yet admitted (including any submitted ahead of their arrival)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Admitted requests not yet finished (prefilling or decoding)."""
        return len(self._running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prefill tokens still to compute, over waiting and running requests."""
        return self._queued_prefill

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens reserved by running requests."""
        return self._kv_used

    def idle(self) -> bool:
        """Whether nothing is waiting or running."""
        return not self._waiting and not self._running

    def result(self, request_id: str) -> RequestResult:
        """A submitted request's times so far (``KeyError`` for an unknown id)."""
        return self._requests[request_id].result()

    def forget(self, request_id: str) -> RequestResult:
        """Drop a finished request's record (long simulations); returns its result. ``ValueError`` if the
        request has not finished."""
        req = self._requests[request_id]
        if req.finish_s is None:
            raise ValueError(f"request {request_id!r} has not finished")
        del self._requests[request_id]
        return req.result()

    def abort(self, request_id: str) -> bool:
        """Drop a request whose client left: out of the queue or the batch, its queued prefill and its KV
        reservation freed from the next step on, its record forgotten. Returns whether it was still
        unfinished (an unknown or finished id is only forgotten)."""
        req = self._requests.pop(request_id, None)
        if req is None or req.finish_s is not None:
            return False
        self._queued_prefill -= req.prefill_left
        if req.admitted_s is None:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
            self._kv_used -= req.kv_tokens
        return True

    # ---- the step loop -----------------------------------------------------------------------------------

    def _plan(self) -> _Plan | None:
        """The next step if there is work, else ``None``; O(running)."""
        profile = self.profile
        if self._running:
            start = self._now
        elif self._waiting:
            start = max(self._now, self._waiting[0].arrival_s)
        else:
            return None
        budget = profile.max_batch_tokens
        decodes: list[_Request] = []
        prefilling: list[_Request] = []
        for req in self._running:
            if req.prefill_left == 0:
                if budget > 0:
                    decodes.append(req)
                    budget -= 1
            else:
                prefilling.append(req)
        chunks: list[tuple[_Request, int]] = []
        for req in prefilling:
            if budget == 0:
                break
            chunk = min(req.prefill_left, budget)
            budget -= chunk
            chunks.append((req, chunk))
        # Admission: FIFO, stopping at the first request that has not arrived, does not fit, or would get no
        # token of this step's budget (it waits, like vLLM's, rather than holding a slot and KV unprocessed).
        admit = 0
        kv = self._kv_used
        slots = profile.max_running - len(self._running)
        for req in self._waiting:
            if budget == 0 or admit >= slots or req.arrival_s > start:
                break
            if kv + req.kv_tokens > profile.kv_capacity_tokens:
                break
            kv += req.kv_tokens
            admit += 1
            chunk = min(req.prefill_left, budget)
            budget -= chunk
            chunks.append((req, chunk))
        cached_read = sum(req.cached_unread for req, _ in chunks)
        prefill_tokens = sum(chunk for _, chunk in chunks)
        duration = step_time_s(profile, prefill_tokens, len(decodes), cached_read)
        return _Plan(start, admit, tuple(decodes), tuple(chunks), cached_read, duration)

    def next_event_time(self) -> float | None:
        """When the next step would end, given what is submitted now; ``None`` if there is no work."""
        plan = self._plan()
        return None if plan is None else plan.start_s + plan.duration_s

    def step(self) -> StepRecord | None:
        """Execute the next step and return it; ``None`` (and nothing changes) if there is no work."""
        plan = self._plan()
        if plan is None:
            return None
        end = plan.start_s + plan.duration_s
        admitted: list[str] = []
        for _ in range(plan.admit):
            req = self._waiting.popleft()
            req.admitted_s = plan.start_s
            self._kv_used += req.kv_tokens
            self._running.append(req)
            admitted.append(req.request_id)
        first: list[str] = []
        finished: list[str] = []
        prefill_tokens = 0
        for req, chunk in plan.chunks:
            req.prefill_left -= chunk
            req.cached_unread = 0
            prefill_tokens += chunk
            self._queued_prefill -= chunk
            if req.prefill_left == 0:
                req.first_token_s = end
                req.decoded = 1
                first.append(req.request_id)
        for req in plan.decodes:
            req.decoded += 1
        still: list[_Request] = []
        for req in self._running:
            if req.prefill_left == 0 and req.decoded >= req.output_tokens:
                req.finish_s = end
                self._kv_used -= req.kv_tokens
                finished.append(req.request_id)
            else:
                still.append(req)
        self._running = still
        self._now = end
        return StepRecord(
            start_s=plan.start_s,
            end_s=end,
            duration_s=plan.duration_s,
            prefill_tokens=prefill_tokens,
            decode_seqs=len(plan.decodes),
            cached_tokens_read=plan.cached_read,
            admitted=tuple(admitted),
            first_tokens=tuple(first),
            finished=tuple(finished),
        )

    def run_until(self, t_s: float) -> list[StepRecord]:
        """Execute every step that ends at or before ``t_s``; submit every request arriving by ``t_s`` first.

        Steps are atomic: one that would end after ``t_s`` is left for a later call. A step admits only the
        requests that arrived by its start, so the result does not depend on how a caller slices time."""
        steps: list[StepRecord] = []
        while True:
            end = self.next_event_time()
            if end is None or end > t_s:
                return steps
            record = self.step()
            assert record is not None
            steps.append(record)

    def run_to_completion(self) -> list[StepRecord]:
        """Execute steps until nothing is waiting or running."""
        steps: list[StepRecord] = []
        while (record := self.step()) is not None:
            steps.append(record)
        return steps
