"""KV pulls between SIMULATED engines: the same requests as kvgate's engine (``POST /v1/kv/cached``, the
frames of ``engine.kv_transfer``), without K/V.

The source answers with the done frame alone, after holding its link for the time the K/V would take to
send (``kv_pull_s_per_token`` per position, one pull at a time); the target counts the positions the done
frame reports as cached, exactly as the real engine does after importing them. Against a real engine as
the source, the K/V frames it sends are read and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from engine.kv_wire import KvTransferError, payload_bytes, read_header
from engine.openai_api import KvPull

log = logging.getLogger("kvgate.sim.kv_pull")


class PeerPuller:
    """The target's side: one HTTP session for every pull this engine makes."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def pull(self, pull: KvPull, body: dict[str, Any]) -> int | None:
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
