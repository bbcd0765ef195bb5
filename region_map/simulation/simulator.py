"""A discrete-event model of engines in several regions, replaying a request trace through a router.

Each simulated engine has an LRU prefix cache of ``capacity_blocks`` trace blocks, a FIFO prefill server
(``prefill_tokens_per_s`` for uncached prompt tokens) and decodes at ``decode_s_per_token``. Time to first
token = the round trip from the client's home region to the engine's + waiting for the prefill server + the
uncached prefill. A router may have an engine pull a prefix a peer holds instead of computing it: the pull
runs over the peer's outbound link (``kv_pull_tokens_per_s``, one pull at a time per sender) and the
request's prefill starts when both the pull and the prefill server are done.

Routing is not modelled here: a ``Router`` decides (the gateway wires in its real policy
objects), and hears every block an engine stores or evicts, as the gateway hears KV events, and every
request's first token, as the gateway sees it stream.

The same replay also runs the references: an unlimited cache (the oracle: no router can do better) and one
pooled LRU holding every engine's capacity (what perfect pooling would give).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from region_map.simulation.trace import TRACE_BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    from perfmodel.profiles import EngineProfile
    from region_map.simulation.batched import BatchedSimEngine, StepHook


@dataclass(frozen=True)
class CostModel:
    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.03
    rtt_s: float = 0.040  # between two different regions; zero within one
    block_tokens: int = TRACE_BLOCK_TOKENS
    # K/V pulled from a peer in the same region: 512 tokens of a 70B model (320 KiB a token) in ~6 ms over
    # a 25 GB/s fabric. Each engine sends one pull at a time.
    kv_pull_tokens_per_s: float = 85_000.0


class LRUBlocks:
    """Block ids in least-recently-used order; ``insert`` reports what it evicted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix(self, blocks: Sequence[int]) -> int:
        n = 0
        for b in blocks:
            if b not in self._blocks:
                break
            n += 1
        return n

    def demote(self, blocks: Sequence[int]) -> None:
        """Make ``blocks`` the next to be evicted (the last of them first)."""
        for b in blocks:
            if b in self._blocks:
                self._blocks.move_to_end(b, last=False)

    def insert(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Touch or add ``blocks``, a prompt's chain; returns (newly stored, in chain order; evicted).

        The chain is touched tail first, so its head ends up the most recent: eviction then takes a chain's
        tail before its head, as vLLM and the simulated engine (``engine.sim.prefix_cache``) free blocks.
        Head first, an evicted head would leave the rest of the chain cached but unreachable (a prefix
        stops at its first missing block), holding capacity that no prompt can hit."""
        stored, evicted = [], []
        for b in reversed(blocks):
            if b in self._blocks:
                self._blocks.move_to_end(b)
            else:
                self._blocks[b] = None
                stored.append(b)
        stored.reverse()
        while len(self._blocks) > self.capacity:
            old, _ = self._blocks.popitem(last=False)
            evicted.append(old)
        return stored, evicted


class SimEngine:
    def __init__(
        self,
        engine_id: str,
        region: str,
        capacity_blocks: int,
        cost: CostModel,
        on_change: Callable[[str, list[int], list[int]], None],
    ) -> None:
        self.id = engine_id
        self.region = region
        self.cost = cost
        self.cache = LRUBlocks(capacity_blocks)
        self._on_change = on_change
        self._prefill_free_at = 0.0
        self._send_free_at = 0.0  # when this engine's outbound K/V link is next free (pulls from it queue)
        self._prefills: deque[tuple[float, float, int]] = deque()  # (start, end, uncached tokens), FIFO
        self._finishing: list[float] = []  # heap of times at which admitted requests finish decoding
        # Blocks stored for a prefill that has not run yet -> when it will have (inf: not known yet). They
        # serve the requests queued here behind it (FIFO), but a peer can pull only computed K/V.
        self._ready_at: dict[int, float] = {}
        self.requests = 0

    def _advance(self, now: float) -> None:
        while self._finishing and self._finishing[0] <= now:
            heapq.heappop(self._finishing)
        while self._prefills and self._prefills[0][1] <= now:
            self._prefills.popleft()

    def in_flight(self, now: float) -> int:
        self._advance(now)
        return len(self._finishing)

    def waiting(self, now: float) -> int:
        """Requests whose prefill has not started by ``now``."""
        self._advance(now)
        return sum(1 for start, _, _ in self._prefills if start > now)

    def queued_prefill_tokens(self, now: float) -> int:
        self._advance(now)
        total = 0
        for start, end, tokens in self._prefills:
            total += tokens if start >= now else round(tokens * (end - now) / (end - start))
        return total

    def room(self, now: float) -> tuple[int, int] | None:
        """(slot limit, free KV tokens), as an engine's load report gives them; None when the model has
        neither (this FIFO model: its queue waits for the one prefill server only)."""
        return None

    def computed_prefix(self, now: float, blocks: Sequence[int]) -> int:
        """The leading ``blocks`` held here with their K/V computed by ``now``: what a pull can send."""
        n = self.cache.prefix(blocks)
        ready_at = self._ready_at
        if ready_at:
            for i in range(n):
                t = ready_at.get(blocks[i])
                if t is not None:
                    if t > now:
                        return i
                    del ready_at[blocks[i]]
        return n

    def pull(self, now: float, blocks: Sequence[int]) -> float:
        """Send ``blocks`` of this engine's cache to a peer; returns when the last one has arrived. The sent
        blocks become the next to be evicted here: the peer's copy is the one in use now, so a pull moves the
        prefix rather than duplicating it (the real engine demotes them the same way)."""
        start = max(now, self._send_free_at)
        self._send_free_at = start + len(blocks) * self.cost.block_tokens / self.cost.kv_pull_tokens_per_s
        self.cache.demote(blocks)
        return self._send_free_at

    def serve(self, now: float, request: TraceRequest, source: SimEngine | None = None) -> tuple[float, int]:
        """Admit ``request``, first pulling from ``source`` the leading blocks it holds beyond this engine's
        own (the last prompt token is always computed here): returns (time of its first token, prompt blocks
        not computed here, local and pulled)."""
        self._advance(now)
        self.requests += 1
        ready, hit = self._find_prefix(now, request, source)
        uncached = max(0, request.input_tokens - hit * self.cost.block_tokens)
        start = max(ready, self._prefill_free_at)
        end = start + uncached / self.cost.prefill_tokens_per_s
        self._prefill_free_at = end
        self._prefills.append((start, end, uncached))
        heapq.heappush(self._finishing, end + request.output_tokens * self.cost.decode_s_per_token)
        self._store(request, end)
        return end, hit

    def _find_prefix(self, now: float, request: TraceRequest, source: SimEngine | None) -> tuple[float, int]:
        """(when the prompt's cached prefix is here, its blocks held here or pulled from ``source``): the
        leading blocks ``source`` holds beyond this engine's own are pulled (the last prompt token is always
        computed here)."""
        hit = self.cache.prefix(request.blocks)
        ready = now
        if source is not None and self.cost.kv_pull_tokens_per_s > 0:
            whole = (request.input_tokens - 1) // self.cost.block_tokens  # blocks before the last token
            held = min(source.computed_prefix(now, request.blocks), whole)
            if held > hit:
                ready = source.pull(now, request.blocks[hit:held])
                hit = held
        return ready, hit

    def _store(self, request: TraceRequest, ready_at: float) -> list[int]:
        """Store the prompt's blocks, computed at ``ready_at``; returns the newly stored ones."""
        # Stored at admission: prefills run FIFO, so anything routed here later finds these blocks computed.
        stored, evicted = self.cache.insert(request.blocks)
        if stored or evicted:
            self._on_change(self.id, stored, evicted)
            pending = self._ready_at
            for b in stored:
                pending[b] = ready_at
            for b in evicted:  # (after: a prompt longer than the cache evicts some of its own new blocks)
                pending.pop(b, None)
        return stored


class Router(Protocol):
    def route(
        self, request: TraceRequest, home: str, now: float, engines: Sequence[SimEngine]
    ) -> tuple[SimEngine, SimEngine | None]:
        """The engine that serves ``request`` (arriving at ``now`` from region ``home``), and the peer it
        pulls the prompt's cached prefix from (None: it computes what it does not hold)."""
        ...

    def kv_changed(self, engine_id: str, stored: list[int], evicted: list[int]) -> None:
        """An engine stored or evicted blocks (the KV events a gateway would receive)."""
        ...

    def first_token(self, n: int, at: float) -> None:
        """The ``n``-th request routed (from 1) got its first token at ``at``: its prefill is done, as a
        gateway learns from the stream. Heard in time order, before the routing of any later arrival."""
        ...


@dataclass
class SimResult:
    requests: int
    hit_rate: float
    oracle_hit_rate: float
    pooled_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    load_max_over_mean: float
    cross_region_share: float
    pull_share: float = 0.0  # requests the router told to pull K/V from a peer
    per_engine_requests: dict[str, int] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        keys = ("hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "load_max_over_mean",
                "cross_region_share", "pooled_hit_rate", "pull_share", "requests")  # fmt: skip
        return {k: getattr(self, k) for k in keys}


def home_region(request: TraceRequest, regions: Sequence[str]) -> str:
    """Clients are spread over regions by conversation: a conversation always comes from the same place."""
    key = request.conversation.to_bytes(8, "little", signed=True)
    return regions[xxhash.xxh3_64_intdigest(key) % len(regions)]


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def simulate(
    trace: Sequence[TraceRequest],
    *,
    regions: Sequence[str],
    engines_per_region: int,
    capacity_blocks: int,
    router: Router,
    cost: CostModel | None = None,
    progress: Callable[[int], None] | None = None,
    profile: EngineProfile | None = None,
    on_step: StepHook | None = None,
) -> SimResult:
    """Replay ``trace``. With ``profile``, every engine is ``perfmodel``'s batching model under it (see
    ``region_map.simulation.batched``; ``on_step`` hears each step); without, the FIFO prefill server of
    ``cost``."""
    cost = cost or CostModel()
    ids = [(f"{region}/e{i}", region) for region in regions for i in range(engines_per_region)]
    batched: list[BatchedSimEngine] = []
    if profile is not None:
        from region_map.simulation.batched import BatchedSimEngine

        batched = [
            BatchedSimEngine(i, r, capacity_blocks, cost, router.kv_changed, profile, on_step) for i, r in ids
        ]
    engines: list[SimEngine] = list(batched) or [
        SimEngine(i, r, capacity_blocks, cost, router.kv_changed) for i, r in ids
    ]
    firsts: list[tuple[float, int]] = []  # (first token, n) not yet told to the router: a heap
    for sim in batched:
        sim.on_first_token = lambda key, at: heapq.heappush(firsts, (at, int(key)))
    pending: list[tuple[BatchedSimEngine, str, float, float]] = []  # (engine, key, arrival, rtt)
    pooled = LRUBlocks(capacity_blocks * len(engines))
    seen: set[int] = set()
    hits = oracle_hits = pooled_hits = total_blocks = cross = pulls = 0
    ttfts: list[float] = []
    for n, request in enumerate(trace, 1):
        now = request.arrival_s
        home = home_region(request, regions)
        for sim in batched:  # the load the router reads is the model's at this arrival
            sim.advance(now)
        while firsts and firsts[0][0] <= now:
            at, done = heapq.heappop(firsts)
            router.first_token(done, at)
        engine, source = router.route(request, home, now, engines)
        if source is not None:
            pulls += 1
        rtt = 0.0 if engine.region == home else cost.rtt_s
        if batched:
            assert isinstance(engine, BatchedSimEngine)
            hit = engine.submit(str(n), now, request, source)
            pending.append((engine, str(n), now, rtt))
        else:
            first_token, hit = engine.serve(now, request, source)
            ttfts.append(rtt + first_token - now)
            heapq.heappush(firsts, (first_token, n))
        cross += engine.region != home
        hits += hit
        total_blocks += len(request.blocks)
        pooled_hits += pooled.prefix(request.blocks)
        pooled.insert(request.blocks)
        oracle = 0
        for b in request.blocks:
            if b not in seen:
                break
            oracle += 1
        oracle_hits += oracle
        seen.update(request.blocks)
        if progress is not None and n % 256 == 0:
            progress(n)
    for sim in batched:
        sim.finish()
    ttfts.extend(rtt + sim.first_token_s(key) - arrival for sim, key, arrival, rtt in pending)
    counts = {e.id: e.requests for e in engines}
    mean = sum(counts.values()) / len(counts)
    return SimResult(
        requests=len(trace),
        hit_rate=hits / total_blocks if total_blocks else 0.0,
        oracle_hit_rate=oracle_hits / total_blocks if total_blocks else 0.0,
        pooled_hit_rate=pooled_hits / total_blocks if total_blocks else 0.0,
        ttft_p50_s=percentile(ttfts, 0.50),
        ttft_p90_s=percentile(ttfts, 0.90),
        ttft_p99_s=percentile(ttfts, 0.99),
        load_max_over_mean=max(counts.values()) / mean if mean else 0.0,
        cross_region_share=cross / len(trace) if trace else 0.0,
        pull_share=pulls / len(trace) if trace else 0.0,
        per_engine_requests=counts,
    )
