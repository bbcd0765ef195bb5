"""KV pulls between SIMULATED engines: the same requests as kvgate's engine (``POST /v1/kv/cached``, the
frames of ``engine.kv_wire``), without K/V.

The source answers with the done frame alone, after holding its link for the time the K/V would take to
send (``send_s_per_token`` per position, one pull at a time), and demotes the blocks it "sent"; the target
counts the positions the done frame reports as cached, exactly as the real engine does after importing
them. Against a real engine as the source, the K/V frames it sends are read and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
import numpy as np
from aiohttp import web

from engine.kv_source_request import kv_source_body, parse_kv_source_request
from engine.kv_wire import CONTENT_TYPE, KvTransferError, pack, payload_bytes, read_header
from engine.metrics import EngineCounters
from engine.openai_api import GenerationRequest, KvPull
from engine.openai_errors import OpenAIError, read_body
from engine.sim.prefix_cache import PrefixCache

log = logging.getLogger("kvgate.sim.kv_pull")

# (prompt token ids, cache salt, shared blocks) -> the prompt's block hashes in the engine's namespace
PromptHashes = Callable[[np.ndarray, str, int], list[int]]


class SimKvPeer:
    """Both sides of one simulated engine's KV pulls: pulling a prefix from a peer, and serving one."""

    def __init__(
        self,
        *,
        model: str,
        block_size: int,
        max_model_len: int,
        send_s_per_token: float,
        cache: PrefixCache,
        counters: EngineCounters,
        prompt_hashes: PromptHashes,
        timeout_s: float = 60.0,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.send_s_per_token = send_s_per_token
        self.cache = cache
        self.counters = counters
        self.prompt_hashes = prompt_hashes
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._sending = asyncio.Lock()  # this engine's outbound K/V link: one pull served at a time

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- the target's side ----------------------------------------------------------------------------

    async def pull(self, req: GenerationRequest, n_cached: int, hashes: list[int]) -> int:
        """Pull what the request's peer holds of the prompt beyond our ``n_cached`` blocks (up to the
        gateway's ``pull_tokens``, never the last prompt token): returns the leading blocks now held, ours
        or pulled. A failed pull returns 0 (everything is computed as usual)."""
        assert req.kv_pull is not None
        bs = self.block_size
        end = min(req.kv_pull.tokens, req.prompt_tokens - 1)
        start = n_cached * bs
        if end <= start:
            return 0
        body = kv_source_body(
            model=self.model,
            block_size=bs,
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids[:end].tolist(),
            from_position=start,
            cache_salt=req.cache_salt,
            cache_shared_blocks=req.cache_shared_blocks,
        )
        got = await self._fetch(req.kv_pull, body)
        sent = 0 if got is None else max(0, min(got, end) - start)
        outcome = "failed" if got is None else "ok" if start + sent == end else "partial"
        self.counters.pulled(outcome, sent)
        return min((start + sent) // bs, len(hashes))

    async def _fetch(self, pull: KvPull, body: dict[str, object]) -> int | None:
        """The positions the peer says it sent (its done frame's ``tokens``), or None when the pull failed
        (logged: the caller computes everything instead)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5)
        try:
            async with self._session.post(f"{pull.url}/v1/kv/cached", json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise KvTransferError(f"peer answered {resp.status}: {(await resp.text())[:200]}")
                while True:
                    item = await read_header(resp.content)
                    if item["t"] == "kv":  # a real engine's K/V: a simulator has nowhere to put it
                        await resp.content.readexactly(payload_bytes(item))
                        continue
                    if item["t"] != "done":
                        raise KvTransferError(f"peer failed: {item.get('message')}")
                    tokens = item.get("tokens")
                    if not isinstance(tokens, int) or tokens < 0:
                        raise KvTransferError(f"done frame without a token count: {item!r}")
                    return tokens
        except (
            KvTransferError,
            aiohttp.ClientError,
            asyncio.IncompleteReadError,
            TimeoutError,
            OSError,
        ) as exc:
            log.warning("KV pull from %s failed, computing instead: %s", pull.url, exc or type(exc).__name__)
            return None

    # -- the source's side ----------------------------------------------------------------------------

    async def handle_cached(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/kv/cached``: the done frame for the positions of the prompt this cache holds from
        ``from_position`` on, after the time sending their K/V would take; those blocks are evicted first
        from now on, since the peer holds them."""
        try:
            req = parse_kv_source_request(
                await read_body(request),
                served_model=self.model,
                block_size=self.block_size,
                max_model_len=self.max_model_len,
            )
        except OpenAIError as exc:
            return exc.to_response({})
        start = req.from_position
        hashes = self.prompt_hashes(req.prompt_token_ids, req.cache_salt, req.cache_shared_blocks)
        # Only computed blocks: those of a prompt still queued here are cached for the prompts queued behind
        # it, but their K/V does not exist yet (a real engine sends what it has).
        run = hashes[: self.cache.match_computed(hashes)]
        end = max(len(run) * self.block_size, start)
        pinned = self.cache.acquire(run)  # held while "sending": a concurrent request must not evict them
        try:
            async with self._sending:
                if end > start and self.send_s_per_token > 0:
                    await asyncio.sleep((end - start) * self.send_s_per_token)
        finally:
            self.cache.release(pinned)
        self.cache.demote(run[start // self.block_size :])
        self.counters.pull_served(end - start)
        done = b"".join(pack({"t": "done", "tokens": end, "cached_tokens": end}))
        return web.Response(body=done, content_type=CONTENT_TYPE)
