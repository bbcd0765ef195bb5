"""The decode engine's side of a KV transfer: pull positions ``start .. end`` from a prefill engine and
write them straight into the blocks already reserved for the sequence.

Only those blocks are written, and no running sequence uses them yet, so this runs on the event loop while
the engine thread keeps stepping. Anything short of every layer of every position ends in KvTransferError;
the caller then frees the reservation.
"""

from __future__ import annotations

import asyncio

import aiohttp

from engine.attention import KVCache
from engine.kv_transfer import KvChunk, KvTransferError, position_slots, read_frame
from engine.llm_engine import ImportTicket
from engine.sequence import CacheNamespace


class KvImporter:
    def __init__(self, kv_cache: KVCache, model_name: str, *, timeout_s: float = 600.0) -> None:
        self.kv_cache = kv_cache
        self.model_name = model_name
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.bytes_received = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, ticket: ImportTicket, source_url: str, namespace: CacheNamespace) -> int:
        """Fetch and store the K/V; returns the tokens the prefill engine found in its own cache."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        body = {
            "model": self.model_name,
            "prompt_token_ids": ticket.prompt_token_ids[: ticket.end],
            "cache_salt": namespace.salt,
            "cache_shared_blocks": namespace.shared_blocks,
            "from_position": ticket.start,
            "block_size": self.kv_cache.block_size,
            "request_id": ticket.request_id,
        }
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=5)
        try:
            async with self._session.post(f"{source_url}/v1/kv/prefill", json=body, timeout=timeout) as resp:
                if resp.status != 200:
                    raise KvTransferError(
                        f"prefill engine answered {resp.status}: {(await resp.text())[:300]}"
                    )
                return await self._receive(resp.content, ticket)
        except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError, OSError) as exc:
            raise KvTransferError(
                f"KV transfer from {source_url} broke: {exc or type(exc).__name__}"
            ) from None

    async def _receive(self, stream: aiohttp.StreamReader, ticket: ImportTicket) -> int:
        cache = self.kv_cache
        slots = position_slots(ticket.block_table, cache.block_size, ticket.start, ticket.end).to(
            cache.k[0].device
        )
        expected = ticket.end - ticket.start
        received = [0] * len(cache.k)
        while True:
            item = await read_frame(stream)
            if isinstance(item, KvChunk):
                count = item.k.shape[0]
                lo, hi = item.start - ticket.start, item.start - ticket.start + count
                if not (0 <= item.layer < len(cache.k) and lo >= 0 and hi <= expected):
                    raise KvTransferError(
                        f"frame for layer {item.layer}, positions {item.start}+{count} is out of range"
                    )
                if item.k.shape[1:] != cache.k[item.layer].shape[1:]:
                    raise KvTransferError(
                        f"frame shape {tuple(item.k.shape)} does not fit this engine's cache"
                    )
                target = slots[lo:hi]
                cache.k[item.layer][target] = item.k.to(cache.k[item.layer].device, cache.k[item.layer].dtype)
                cache.v[item.layer][target] = item.v.to(cache.v[item.layer].device, cache.v[item.layer].dtype)
                received[item.layer] += count
                self.bytes_received += 2 * item.k.numel() * item.k.element_size()
            elif item["t"] == "done":
                if any(r != expected for r in received):
                    raise KvTransferError(
                        f"transfer ended with {min(received)} of {expected} positions in some layer"
                    )
                return int(item.get("cached_tokens", 0))
            else:
                raise KvTransferError(f"prefill engine failed: {item.get('message')}")
