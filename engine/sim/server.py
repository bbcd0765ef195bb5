"""The SIMULATED engine: an OpenAI-compatible HTTP server whose "inference" is a cost model.

It generates no real text: it sleeps for the time a real engine would spend and answers with deterministic
pseudo-text. What it simulates faithfully is what the gateway cares about: a FIFO admission queue of
``max_running`` slots, an LRU prefix cache of block hashes (contract 1) whose changes go out as KV events
(contract 3), and ``cached_tokens`` in the usage (contract 2).

Cost model per request (``engine/sim/slot_path.py``): wait for a slot; prefill sleeps ``uncached prompt
tokens × prefill_s_per_token``; then each output token costs ``decode_s_per_token``. With every cost at 0
nothing sleeps, so benchmarks measure pure HTTP overhead. With a ``profile`` (``--profile NAME``) requests
share one batching step loop instead, whose steps cost what ``perfmodel`` says, so they queue behind each
other's work (``engine/sim/batching_loop.py``). This module holds the state both modes share (prefix cache,
KV events and pulls, counters) and the HTTP handlers.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import orjson
import xxhash
from aiohttp import web

from cache.chat_dialect import VLLM
from cache.chat_template import render_messages
from cache.hashing import block_hashes, chain_parent, namespace_seed, namespaced_block_hashes
from cache.tokens import load_tokenizer
from engine.embeddings_api import EMBEDDINGS_PATH
from engine.kv_publisher import KvEventPublisher
from engine.metrics import EngineCounters, EngineGauges, metrics_handler
from engine.openai_api import FinishReason, GenerationRequest, RequestKind, new_request_id, parse_request
from engine.openai_errors import MAX_BODY_BYTES, OpenAIError, json_response, openai_routing_errors, read_body
from engine.openai_format import model_object, models_body
from engine.sim.batching_loop import BatchingLoop, generate_batched
from engine.sim.config import SimEngineConfig
from engine.sim.embeddings import handle_embeddings
from engine.sim.kv_pull import SimKvPeer
from engine.sim.prefix_cache import PrefixCache
from engine.sim.pseudo_text import cut_at_stop, pseudo_text
from engine.sim.slot_path import SlotQueue, generate_per_request

__all__ = ["SIM_ENGINE", "SimEngine", "SimEngineConfig", "build_app"]

REQUEST_ID_HEADER = "x-request-id"
SERVED_KEPT = 2**20


@functools.lru_cache(maxsize=4096)
def _namespace_seed(model: str, cache_salt: str) -> int:
    return namespace_seed(model, cache_salt)


# ------------------------------------------------------------------------------------------- engine


def prompt_key(token_ids: np.ndarray) -> int:
    """A prompt's key in ``/debug/served``: the same for its text and for its ids (the gateway's), which the
    engine tokenizes to the same array."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(token_ids, dtype=np.uint32).tobytes())


class SimEngine:
    """The simulator's state and HTTP handlers; :func:`build_app` wires them into an application."""

    def __init__(self, config: SimEngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.publisher = KvEventPublisher(
            config.engine_id, config.block_size, heartbeat_s=config.kv_heartbeat_s
        )
        self.cache = PrefixCache(config.capacity_blocks, on_events=self.publisher.publish)
        self.created = int(time.time())
        # Each prompt it was sent (xxh3-64 of its token ids), in arrival order: where a router placed each
        # request of a replay, read back by the benches (GET /debug/served) whatever the router forwards.
        # The last million only: a simulator left running keeps no more than ~40 MB of them.
        self.served: collections.deque[int] = collections.deque(maxlen=SERVED_KEPT)
        self.slots = SlotQueue(config.max_running)  # the per-request mode's admission
        self.counters = EngineCounters()
        profile = config.engine_profile()
        self.batching = None if profile is None else BatchingLoop(profile, self.counters)
        self._public_seed = _namespace_seed(config.model, "")  # of operator-declared shared prefixes
        self.kv_peer = SimKvPeer(
            model=config.model,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            send_s_per_token=config.kv_pull_s_per_token,
            cache=self.cache,
            counters=self.counters,
            prompt_hashes=self.prompt_hashes,
        )

    def prompt_hashes(self, ids: np.ndarray, cache_salt: str, shared_blocks: int) -> list[int]:
        """The block hashes of a prompt in this engine's namespace (contract 1)."""
        return namespaced_block_hashes(
            ids, self.config.block_size, _namespace_seed(self.config.model, cache_salt),
            public_seed=self._public_seed, shared_blocks=shared_blocks,
        )  # fmt: skip

    def gauges(self) -> EngineGauges:
        used, free, _ = self.kv_blocks()
        return EngineGauges(self.running, self.waiting, used, free)

    def kv_blocks(self) -> tuple[int, int, int]:
        """(used, free, total) KV blocks as an engine reports them: per request, the prefix cache's; in the
        batching mode, the KV that running requests hold in the model (what admission waits for; cached
        blocks no request holds count as free, as a real engine's evictable blocks do)."""
        if self.batching is None:
            return self.cache.used, self.cache.free, self.config.capacity_blocks
        size = self.config.block_size
        total = self.batching.profile.kv_capacity_tokens // size
        used = min(total, -(-self.batching.kv_used_tokens // size))
        return used, total - used, total

    @property
    def running(self) -> int:
        return self.slots.running if self.batching is None else self.batching.running

    @property
    def waiting(self) -> int:
        return self.slots.waiting if self.batching is None else self.batching.waiting

    @property
    def waiting_tokens(self) -> int:
        return self.slots.waiting_tokens if self.batching is None else self.batching.waiting_tokens

    @contextlib.contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        """Count the time inside as this engine's busy seconds of ``stage``."""
        clock = self.counters.busy[stage]
        clock.enter()
        try:
            yield
        finally:
            clock.exit()

    # ------------------------------------------------------------------------------------- handlers

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def handle_embeddings(self, request: web.Request) -> web.Response:
        """Pseudo-embeddings, validated and shaped as kvgate's engine's (``engine.sim.embeddings``)."""
        return await handle_embeddings(self, request)

    async def handle_models(self, request: web.Request) -> web.Response:
        return json_response(models_body(self.config.model, self.created))

    async def handle_model_card(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{model}`` (the SDK's ``models.retrieve``), as kvgate's engine answers it."""
        model = request.match_info["model"]
        if model != self.config.model:
            message = f"The model `{model[:200]}` does not exist."
            return OpenAIError(message, status=404, param="model", code="model_not_found").to_response()
        return json_response(orjson.dumps(model_object(model, self.created)))

    # ------------------------------------------ what other routers probe (tests/bench/bench_routers.py)

    def _model_info(self) -> dict[str, Any]:
        path = self.config.tokenizer or self.config.model
        return {"model_path": path, "tokenizer_path": path, "served_model_name": self.config.model,
                "is_generation": True, "max_total_num_tokens": self.config.max_model_len}  # fmt: skip

    async def handle_model_info(self, request: web.Request) -> web.Response:
        """SGLang's ``/model_info`` and ``/server_info``, which sglang-router reads."""
        return json_response(orjson.dumps(self._model_info()))

    async def handle_tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize`` (vllm-router's cache-aware policy asks it for every request)."""
        try:
            body = orjson.loads(await read_body(request))
            messages = body.get("messages")
            if messages is not None:
                text = render_messages(self.tokenizer, messages, dialect=VLLM, inputs=VLLM.chat_inputs(body))
            else:
                text = body["prompt"]
            tokens = self.tokenizer.encode(text).tolist()
        except OpenAIError as exc:
            return exc.to_response({})
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as exc:
            return OpenAIError(f"cannot tokenize: {exc}").to_response({})
        body = {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens}
        return json_response(orjson.dumps(body))

    async def handle_served(self, request: web.Request) -> web.Response:
        """``GET /debug/served``: the prompts this engine was sent (``prompt_key``), in arrival order."""
        return json_response(orjson.dumps({"engine_id": self.config.engine_id, "prompts": list(self.served)}))

    async def handle_health(self, request: web.Request) -> web.Response:
        return json_response(orjson.dumps(self.health()))

    def health(self) -> dict[str, Any]:
        """The /health body; its shape is what the gateway's health poller reads."""
        cfg = self.config
        used, free, total = self.kv_blocks()
        return {
            "status": "ok",
            "engine_id": cfg.engine_id,
            "role": "both",
            "model": cfg.model,
            "block_size": cfg.block_size,
            "kv_events": True,
            "kv_pull": True,
            "token_ids_hex": True,  # takes prompt_token_ids_hex
            "simulated": True,
            "load": {
                "running": self.running,
                "waiting": self.waiting,
                "waiting_tokens": self.waiting_tokens,
                "max_running": self.batching.profile.max_running if self.batching else cfg.max_running,
                "kv_blocks_used": used,
                "kv_blocks_free": free,
                "kv_blocks_total": total,
            },
        }

    async def _generate(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or new_request_id()
        headers = {REQUEST_ID_HEADER: request_id}
        cfg = self.config
        try:
            body = await read_body(request)
            req = parse_request(
                body,
                kind,
                served_model=cfg.model,
                tokenizer=self.tokenizer,
                request_id=request_id,
                max_model_len=cfg.max_model_len,
                # Its pseudo-text has no end of sequence: filling a 128k context would stream for minutes.
                chat_fills_context=False,
            )
        except OpenAIError as exc:
            return exc.to_response(headers)
        self.served.append(prompt_key(req.prompt_token_ids))
        if self.batching is not None:
            return await generate_batched(self, request, req, headers)
        return await generate_per_request(self, request, req, headers)

    async def cached_blocks(self, req: GenerationRequest, hashes: list[int]) -> int:
        """How many of the prompt's blocks need no prefill: in the prefix cache or pulled from a peer."""
        n_cached = self.cache.match(hashes)
        if req.kv_pull is not None:
            n_cached = max(n_cached, await self.kv_peer.pull(req, n_cached, hashes))
        return self.usable_blocks(req, n_cached)

    def usable_blocks(self, req: GenerationRequest, n_cached: int) -> int:
        """Of ``n_cached`` leading blocks cached, those the prompt takes from the cache. Its last token is
        always computed (its logits start the decode), as kvgate's own engine, vLLM and SGLang do: a prompt
        of whole blocks finds one block less in the cache."""
        return min(n_cached, (req.prompt_tokens - 1) // self.config.block_size)

    @staticmethod
    def answer(req: GenerationRequest) -> tuple[str, FinishReason]:
        """The deterministic pseudo-answer (cut at a stop string) and why it ends."""
        seed = req.seed if req.seed is not None else xxhash.xxh3_64_intdigest(req.prompt_token_ids.tobytes())
        return cut_at_stop(pseudo_text(seed, req.max_tokens), req.stop)

    def store_answer(self, req: GenerationRequest, hashes: list[int], text: str) -> None:
        """Cache the full blocks of prompt + answer: a chat's next turn starts with exactly those tokens.

        The whole chain is stored, not just the answer's blocks, so that under pressure the answer cannot
        evict its own prompt and be left hanging on a missing parent.
        """
        ids, shared_blocks = req.prompt_token_ids, req.cache_shared_blocks
        ns_seed = _namespace_seed(self.config.model, req.cache_salt)
        bs = self.config.block_size
        tail_start = len(hashes) * bs
        chain = hashes
        if text and ids.shape[0] - tail_start + len(text) >= bs:
            out_ids = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.uint32)
            tail = np.concatenate((ids[tail_start:], out_ids))
            chain = hashes + block_hashes(
                tail, bs, ns_seed, parent=chain_parent(hashes, shared_blocks, ns_seed, self._public_seed)
            )
        self.cache.store(chain)


SIM_ENGINE = web.AppKey("kvgate_sim_engine", SimEngine)


def build_app(config: SimEngineConfig) -> web.Application:
    """The simulator as an aiohttp application; ``app[SIM_ENGINE]`` is its :class:`SimEngine`.

    Run it with ``web.AppRunner(app, handler_cancellation=True)`` so that a client that disconnects
    cancels its request and frees its slot (:func:`engine.sim.run.serve` does).
    """
    engine = SimEngine(config)
    # Routing errors as OpenAI's JSON, as kvgate's engine answers them (aiohttp's are text/plain).
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[openai_routing_errors])
    app[SIM_ENGINE] = engine
    app.router.add_post("/v1/completions", engine.handle_completions)
    app.router.add_post("/v1/chat/completions", engine.handle_chat)
    app.router.add_post(EMBEDDINGS_PATH, engine.handle_embeddings)
    app.router.add_get("/v1/models", engine.handle_models)
    app.router.add_get("/v1/models/{model:.+}", engine.handle_model_card)  # (ids may hold slashes)
    app.router.add_get("/health", engine.handle_health)
    app.router.add_get("/debug/served", engine.handle_served)
    app.router.add_get("/model_info", engine.handle_model_info)
    app.router.add_get("/server_info", engine.handle_model_info)
    app.router.add_post("/tokenize", engine.handle_tokenize)
    app.router.add_post("/v1/kv/cached", engine.kv_peer.handle_cached)
    app.router.add_get("/metrics", metrics_handler(config.engine_id, engine.counters, engine.gauges))
    engine.publisher.add_routes(app)

    async def close_kv_peer(app: web.Application) -> None:
        await engine.kv_peer.close()
        if engine.batching is not None:
            await engine.batching.close()

    app.on_cleanup.append(close_kv_peer)
    return app
