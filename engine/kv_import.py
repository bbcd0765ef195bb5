"""The receiving side of a KV transfer: fetch positions ``start .. end`` of a prompt from another engine and
write them straight into the blocks already reserved for the sequence.

Two sources, one wire format (``engine.kv_transfer``): a prefill engine computes the positions and streams
them (``/v1/kv/prefill``, disaggregation), or a peer engine sends what its prefix cache already holds
(``/v1/kv/cached``, a KV pull), which may be fewer positions than asked for.

Only those blocks are written, and no running sequence uses them yet, so this runs on the event loop while
the engine thread keeps stepping. Anything short of every layer of every position the source announced ends
in KvTransferError; the caller then frees the reservation (prefill) or computes the positions itself (pull).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from engine.attention import KVCache
from engine.engine_types import ImportTicket
from engine.kv_source_request import kv_source_body
from engine.kv_transfer import KvChunk, KvTransferError, position_slots, read_frame
from engine.sequence import CacheNamespace


class KvImporter:
    def __init__(
        self, kv_cache: KVCache, model_name: str, *, timeout_s: float = 600.0, pull_timeout_s: float = 60.0
    ) -> None:
        self.kv_cache = kv_cache
        self.model_name = model_name
        self.timeout_s = timeout_s
        # A pull computes nothing at the source, so it should finish quickly; one that hangs would hold its
        # request back for nothing, since the positions can always be computed here instead.
        self.pull_timeout_s = pull_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.bytes_received = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """Have a prefill engine compute the positions and store them; returns the tokens the prefill engine
        found in its own cache."""
        done = await self._fetch(f"{source_url}/v1/kv/prefill", ticket, namespace, self.timeout_s)
        if done["tokens"] != ticket.end:
            raise KvTransferError(f"the prefill engine sent {done['tokens']} of {ticket.end} positions")
        return done["cached_tokens"]

    async def pull(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """Pull the positions from a peer's prefix cache and store them; returns the end of those stored
        (from ``ticket.start``, all of them, up to ``ticket.end``: the peer may have evicted the rest)."""
        done = await self._fetch(f"{source_url}/v1/kv/cached", ticket, namespace, self.pull_timeout_s)
        return done["tokens"]

    async def _fetch(
        self, url: str, ticket: ImportTicket, namespace: CacheNamespace, timeout_s: float
    ) -> dict[str, int]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = kv_source_body(
            model=self.model_name,
            block_size=self.kv_cache.block_size,
            request_id=ticket.request_id,
            prompt_token_ids=ticket.prompt_token_ids[: ticket.end],
            from_position=ticket.start,
            cache_salt=namespace.salt,
            cache_shared_blocks=namespace.shared_blocks,
        )
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=5)
        try:
            async with self._session.post(url, json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise KvTransferError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
                return await self._receive(resp.content, ticket)
        except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            raise KvTransferError(f"KV transfer from {url} broke: {exc or type(exc).__name__}") from None

    async def _receive(self, stream: aiohttp.StreamReader, ticket: ImportTicket) -> dict[str, int]:
        """Store frames until the done frame; returns its ``tokens`` and ``cached_tokens``, having checked
        that every layer received exactly positions ``ticket.start .. tokens``."""
        cache = self.kv_cache
        slots = position_slots(ticket.block_table, cache.block_size, ticket.start, ticket.end).to(
            cache.k[0].device
        )
        expected = ticket.end - ticket.start
        received = [0] * len(cache.k)  # each layer's positions arrive in order: ticket.start + received
        while True:
            item = await read_frame(stream)
            if isinstance(item, KvChunk):
                count = item.k.shape[0]
                lo, hi = item.start - ticket.start, item.start - ticket.start + count
                if not (0 <= item.layer < len(cache.k) and lo == received[item.layer] and hi <= expected):
                    raise KvTransferError(
                        f"frame for layer {item.layer}, positions {item.start}+{count} out of order or range"
                    )
                if item.k.shape[1:] != cache.k[item.layer].shape[1:]:
                    raise KvTransferError(
                        f"frame shape {tuple(item.k.shape)} does not fit this engine's cache"
                    )
                target = slots[lo:hi]
                cache.k[item.layer][target] = item.k.to(cache.k[item.layer].device, cache.k[item.layer].dtype)
                cache.v[item.layer][target] = item.v.to(cache.v[item.layer].device, cache.v[item.layer].dtype)
                received[item.layer] = hi
                self.bytes_received += 2 * item.k.numel() * item.k.element_size()
            elif item["t"] == "done":
                return _done(item, ticket, received)
            else:
                raise KvTransferError(f"the source engine failed: {item.get('message')}")


def _done(header: dict[str, Any], ticket: ImportTicket, received: list[int]) -> dict[str, int]:
    """The done frame's counts, once every layer holds every position it announces."""
    try:
        tokens, cached = int(header.get("tokens", ticket.end)), int(header.get("cached_tokens", 0))
    except (TypeError, ValueError):
        raise KvTransferError(f"malformed done frame {header!r}") from None
    if not ticket.start <= tokens <= ticket.end:
        raise KvTransferError(f"the source announced {tokens} positions of {ticket.start}..{ticket.end}")
    if any(r != tokens - ticket.start for r in received):
        raise KvTransferError(
            f"transfer ended with {min(received)} of {tokens - ticket.start} positions in some layer"
        )
    return {"tokens": tokens, "cached_tokens": cached}
