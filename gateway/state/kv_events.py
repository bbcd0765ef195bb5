"""Follows one engine's KV events (contract 3) into the shared state, outside the request path.

Start from a snapshot, then stream batches after its ``seq``. A gap in ``seq``, a stream that fell too far
behind (410), or an engine that restarted sends the consumer back to a fresh snapshot: never guess.
An engine without the event endpoints (a stock vLLM, say) is marked as publishing none, so the gateway
records its own routing decisions for it instead. An ``https://`` engine is followed over TLS with the
session's connector, built by the gateway with its one engine TLS context. A message (a snapshot, or one
batch of the stream) over ``gateway.kv_event_max_message_bytes`` is refused before it is whole, as the ZMQ
followers refuse one: a broken engine cannot take the gateway's memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import aiohttp
import msgpack

from cache.events import EventDecodeError, KvEventBatch, batch_from_obj, decode_snapshot
from gateway.config import GatewaySettings
from region_map.fleet import EngineState

log = logging.getLogger("kvgate.kv_events")

_MAX_MESSAGE_BYTES: int = GatewaySettings.model_fields["kv_event_max_message_bytes"].default


class EventSink(Protocol):
    async def apply_events(self, engine: str, batch: KvEventBatch) -> bool: ...

    async def resync(self, engine: str, hashes: list[int], seq: int) -> None: ...


class _Resync(Exception):
    """The stream can no longer be trusted to continue from where we are."""


class _Oversized(Exception):
    """The engine sent a message over the size limit: what follows it cannot be read."""


class KvEventConsumer:
    def __init__(
        self,
        engine: EngineState,
        session: aiohttp.ClientSession,
        sink: EventSink,
        *,
        idle_timeout_s: float = 15.0,
        max_backoff_s: float = 5.0,
        max_message_bytes: int = _MAX_MESSAGE_BYTES,
    ) -> None:
        self.engine = engine
        self._session = session
        self._sink = sink
        self._idle_timeout_s = idle_timeout_s
        self._max_backoff_s = max_backoff_s
        self._max_message_bytes = max_message_bytes  # gateway.kv_event_max_message_bytes
        self.batches = 0
        self.resyncs = 0
        self.unknown_events = 0  # events of a kind this gateway does not know (a newer engine), skipped
        self.oversized_messages = 0  # snapshots and batches refused for their size (the stream is left)
        self.last_seq: int | None = None

    async def run(self) -> None:
        backoff = 0.2
        while True:
            try:
                after = await self._snapshot()
                if after is None:
                    return
                backoff = 0.2
                await self._follow(after)
            except asyncio.CancelledError:
                raise
            except _Resync as why:
                log.info("engine %s: resynchronising (%s)", self.engine.id, why)
                continue
            except _Oversized as exc:
                self._count_oversized(str(exc))
            except (aiohttp.ClientError, TimeoutError, OSError, EventDecodeError, ValueError) as exc:
                log.debug("engine %s: event stream interrupted: %s", self.engine.id, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._max_backoff_s)

    async def _snapshot(self) -> int | None:
        timeout = aiohttp.ClientTimeout(total=30)
        async with self._session.get(f"{self.engine.url}/v1/kv_snapshot", timeout=timeout) as resp:
            if resp.status in (404, 405, 501):
                self.engine.publishes_events = False
                log.info(
                    "engine %s publishes no KV events; routing on the gateway's own records", self.engine.id
                )
                return None
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            snapshot = decode_snapshot(await self._read_whole(resp))
        self.engine.publishes_events = True
        await self._sink.resync(self.engine.id, list(snapshot.block_hashes), snapshot.seq)
        self.resyncs += 1
        self.last_seq = snapshot.seq
        return snapshot.seq

    async def _follow(self, after: int) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self._idle_timeout_s)
        url = f"{self.engine.url}/v1/kv_events"
        async with self._session.get(url, params={"after": str(after)}, timeout=timeout) as resp:
            if resp.status == 410:
                raise _Resync("engine no longer holds the batches after our snapshot")
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
            # (Bounded: msgpack's default, 100 MiB, is not the setting, and BufferFull is no ValueError.)
            unpacker = msgpack.Unpacker(max_buffer_size=self._max_message_bytes)
            last = after
            async for data in resp.content.iter_any():
                try:
                    unpacker.feed(data)
                except msgpack.BufferFull:
                    raise _Oversized("a KV event batch") from None
                for obj in unpacker:
                    if obj is None:
                        continue  # heartbeat
                    batch = batch_from_obj(obj)
                    if batch.seq != last + 1:
                        raise _Resync(f"seq gap: expected {last + 1}, got {batch.seq}")
                    if batch.unknown_events and not self.unknown_events:
                        log.warning(
                            "engine %s sends KV events of a kind this gateway does not know (a newer "
                            "engine?); skipping them and applying the rest",
                            self.engine.id,
                        )
                    self.unknown_events += batch.unknown_events
                    await self._sink.apply_events(self.engine.id, batch)
                    last = self.last_seq = batch.seq
                    self.batches += 1
        raise _Resync("event stream ended")

    async def _read_whole(self, resp: aiohttp.ClientResponse) -> bytes:
        """The response's body, refused once it is over the size limit."""
        body = bytearray()
        async for data in resp.content.iter_any():
            body += data
            if len(body) > self._max_message_bytes:
                raise _Oversized("a KV snapshot")
        return bytes(body)

    def _count_oversized(self, what: str) -> None:
        self.oversized_messages += 1
        if self.oversized_messages > 1:  # said once per engine: every refusal is counted in the metrics
            return
        log.warning(
            "engine %s sent %s over gateway.kv_event_max_message_bytes (%d bytes); it was refused and the "
            "follower starts over from a snapshot (raise the setting if the engine's messages are that "
            "large; further refusals are counted in kvgate_kv_event_oversized_messages_total, not logged)",
            self.engine.id, what, self._max_message_bytes,
        )  # fmt: skip
