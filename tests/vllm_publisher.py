"""A test publisher that speaks vLLM's KV event protocol (vllm/distributed/kv_events.py, vLLM 0.32.0).

What it reproduces from ``ZmqEventPublisher``:

- the PUB socket binds when the endpoint holds ``*`` or ``::`` or is ``ipc://``/``inproc://``, and connects
  otherwise (then the subscriber must bind);
- live messages are three frames ``[topic, seq as 8-byte big-endian, msgpack payload]``; ``seq`` starts at 0
  and rises by one per batch;
- the payload is ``EventBatch`` encoded ``array_like``: ``[ts, events, data_parallel_rank]``; each event is
  a map whose first key is ``"type"`` (vLLM >= ~0.26, ``encoding="map"``), fields left at their default
  omitted (``omit_defaults``), or a tagged positional array ``[tag, field, ...]`` holding every field
  (older vLLM, and SGLang: ``encoding="positional"``; msgspec omits nothing from an array). The map
  encoding was checked byte for byte against vLLM 0.32.0's own msgspec encoder;
- a ROUTER socket on the replay endpoint answers a DEALER's ``[b"", start_seq]`` with one message per
  buffered batch whose seq >= start_seq, then an end marker whose seq is -1. vLLM 0.32 puts the topic in
  each answer (``[b"", topic, seq, payload]``, end ``[b"", b"", ff..ff, b""]``); older vLLM and SGLang do
  not (``[b"", seq, payload]``): ``replay_topic_frame`` picks one;
- the replay buffer keeps the last ``buffer_steps`` batches;
- data-parallel rank ``r`` publishes on both endpoints' port + ``r``, and stamps ``r`` into each batch.

Not reproduced: vLLM's ``tcp://*:0`` (bind the node's IP on a free port); the live socket is an XPUB (a PUB
that also reads its subscribers' subscriptions: the same on the wire), so ``wait_for_subscriber()`` can
wait out ZMQ's slow joiner. Replay answers and the end marker match frames recorded from vLLM 0.32.0
(tests/data/vllm-0.32.0-kv-events).

Test extras: ``publish(..., drop=True)`` buffers a batch without sending it live (a missed message),
``publish(..., payload=...)`` sends given bytes (recorded frames, malformed input), ``restart()`` sets seq
back to 0 and empties the buffer (an engine restart; ``reopen=True`` also drops connections),
``forget_before(seq)`` trims the buffer as a full one would, and ``vllm_block_hashes``
computes vLLM-style opaque chained block hashes (sha256 over the parent digest, the block's tokens and its
extra keys; the last 8 bytes as an int), so a fake engine's hashes behave like vLLM's: equal for equal
prefixes, different under a different salt or LoRA.
"""

from __future__ import annotations

import hashlib
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, cast

import msgpack
import zmq

Encoding = Literal["map", "positional"]
ExternalBlockHash = int | bytes

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BlockStored:
    """vLLM's ``BlockStored``, fields in vLLM's order. The first seven have no default in vLLM and are always
    on the wire; the rest are omitted while they hold their default (None)."""

    block_hashes: Sequence[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_GPU
    lora_name: str | None = None
    extra_keys: Sequence[tuple[Any, ...] | None] | None = None
    group_idx: int | None = 0
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    _REQUIRED = 7


@dataclass
class BlockRemoved:
    """vLLM's ``BlockRemoved``: ``block_hashes`` and ``medium`` always, the rest while not None."""

    block_hashes: Sequence[ExternalBlockHash]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = 0
    locality: str | None = None
    ownership: str | None = None

    _REQUIRED = 2


@dataclass
class AllBlocksCleared:
    """vLLM's ``AllBlocksCleared``: no fields."""

    _REQUIRED = 0


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_event(event: VllmEvent, encoding: Encoding = "map") -> dict[str, Any] | list[Any]:
    """The msgpack-ready shape msgspec gives a tagged struct: a map led by ``"type"``, or ``[tag, ...]``."""
    tag = type(event).__name__
    values = [(f.name, getattr(event, f.name)) for f in fields(event)]
    required = event._REQUIRED
    if encoding == "map":
        out: dict[str, Any] = {"type": tag}
        for i, (name, value) in enumerate(values):
            if i < required or value is not None:
                out[name] = value
        return out
    # msgspec writes every field of an array_like struct, defaults included (checked against msgspec).
    return [tag, *(value for _, value in values)]


def encode_batch(
    events: Sequence[VllmEvent | dict[str, Any] | list[Any]],
    ts: float,
    data_parallel_rank: int | None,
    encoding: Encoding = "map",
) -> bytes:
    """An ``EventBatch`` payload. Events already in wire shape (dict or list) pass through untouched, so a
    test can send SGLang's or a malformed event too. A None rank is omitted, as ``omit_defaults`` does."""
    wire = [e if isinstance(e, dict | list) else encode_event(e, encoding) for e in events]
    batch: list[Any] = [ts, wire] if data_parallel_rank is None else [ts, wire, data_parallel_rank]
    return cast(bytes, msgpack.packb(batch))


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: rank r publishes on the endpoint's port + r (inproc gets a suffix)."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + data_parallel_rank}" if base else endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


def binds(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def free_tcp_ports(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback TCP ports that are free right now (data-parallel ranks
    use base + rank)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = int(probe.getsockname()[1])
        if base + count > 65535:
            continue
        held: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def _bind(sock: zmq.Socket[bytes], endpoint: str) -> None:
    # Reopening right after a close: ZMQ's I/O thread may not have released the port yet.
    deadline = time.monotonic() + 2.0
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


class VllmPublisher:
    """vLLM's ``ZmqEventPublisher`` for tests: ``publish`` sends synchronously (no queue), a thread answers
    replay requests as vLLM's publisher thread does. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        encoding: Encoding = "map",
        buffer_steps: int = 10_000,
        replay_topic_frame: bool = True,
        stamp_rank: bool = True,
        hwm: int = 100_000,
    ) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.encoding: Encoding = encoding
        self.topic = topic.encode()
        self.replay_topic_frame = replay_topic_frame
        self.stamp_rank = stamp_rank  # SGLang before attn_dp_rank: the batch is only [ts, events]
        self.endpoint = cast(str, offset_endpoint_port(endpoint, data_parallel_rank))
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._hwm = hwm
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self.replays_served = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._running = False
        self._thread: threading.Thread | None = None
        self._open()

    # -- sockets ---------------------------------------------------------------------------------------

    def _open(self) -> None:
        # XPUB is a PUB that also hands over its subscribers' subscriptions: the wire is the same for
        # them, and a test can wait for a (re)connected subscriber instead of sleeping.
        pub: zmq.Socket[bytes] = self._ctx.socket(zmq.XPUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if binds(self.endpoint):
            _bind(pub, self.endpoint)
        else:
            pub.connect(self.endpoint)
        self._pub = pub
        if self.replay_endpoint is not None:
            router: zmq.Socket[bytes] = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            _bind(router, self.replay_endpoint)
            self._replay = router
            self._running = True
            self._thread = threading.Thread(target=self._serve_replay, name="vllm-replay", daemon=True)
            self._thread.start()

    def _close_sockets(self) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None

    def close(self) -> None:
        self._close_sockets()
        self._ctx.term()

    def __enter__(self) -> VllmPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- publishing ------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(
        self,
        events: Sequence[VllmEvent | dict[str, Any] | list[Any]],
        ts: float | None = None,
        *,
        drop: bool = False,
        payload: bytes | None = None,
    ) -> int:
        """Publish one batch (one engine step) and return its seq. ``drop`` keeps it in the replay buffer
        but never sends it live: a message the subscriber missed. ``payload`` sends those bytes instead of
        encoding ``events`` (recorded frames, malformed input)."""
        if payload is None:
            rank = self.data_parallel_rank if self.stamp_rank else None
            payload = encode_batch(events, time.time() if ts is None else ts, rank, self.encoding)
        with self._lock:
            seq = self._seq
            self._seq += 1
            if not drop:
                assert self._pub is not None, "publisher is closed"
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
        return seq

    def restart(self, *, reopen: bool = False) -> None:
        """What an engine restart looks like to a subscriber: seq starts at 0 again, the buffer is empty.
        ``reopen`` also closes and reopens the sockets (subscribers see their connection drop)."""
        if reopen:
            self._close_sockets()
        with self._lock:
            self._seq = 0
            self._buffer.clear()
        if reopen:
            self._open()

    def reconnect(self) -> None:
        """Close and reopen the sockets, history kept: subscribers see their connection drop (a network
        blip, a proxy restarting), and the next batch follows the last one."""
        self._close_sockets()
        self._open()

    def wait_for_subscriber(self, timeout_s: float = 3.0) -> None:
        """Block until a subscriber's subscription reaches this socket (after a connect or reconnect):
        what is published before that is lost to it (ZMQ's slow joiner)."""
        assert self._pub is not None, "publisher is closed"
        if not self._pub.poll(int(timeout_s * 1000)):
            raise TimeoutError("no subscriber subscribed")
        while self._pub.poll(0):
            self._pub.recv()

    def forget_before(self, seq: int) -> None:
        """Drop buffered batches older than ``seq``, as a full buffer would have."""
        with self._lock:
            while self._buffer and self._buffer[0][0] < seq:
                self._buffer.popleft()

    # -- replay ----------------------------------------------------------------------------------------

    def _serve_replay(self) -> None:
        router = self._replay
        assert router is not None
        while self._running:
            try:
                if not router.poll(10):
                    continue
                frames = router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and ignores it
            client_id, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                batches = [(seq, buf) for seq, buf in self._buffer if seq >= start]
            for seq, buf in batches:
                if self.replay_topic_frame:
                    router.send_multipart((client_id, b"", self.topic, seq.to_bytes(8, "big"), buf))
                else:
                    router.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
            if self.replay_topic_frame:
                router.send_multipart((client_id, b"", b"", END_SEQ, b""))
            else:
                router.send_multipart((client_id, b"", END_SEQ, b""))
            self.replays_served += 1


# -- vLLM-style engine hashes ----------------------------------------------------------------------------


@dataclass
class VllmHashes:
    """A chain of vLLM-style block hashes: the full digests (which the chain continues from) and the
    published 64-bit ids (the digest's last 8 bytes, big-endian, as vLLM's ``maybe_convert_block_hash``)."""

    digests: list[bytes] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


NONE_HASH = hashlib.sha256(b"vllm-test-none-hash").digest()


def vllm_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes | None = None,
    start_token: int = 0,
    cache_salt: str | None = None,
    lora_name: str | None = None,
    none_hash: bytes = NONE_HASH,
) -> VllmHashes:
    """vLLM's chained hash over full blocks: sha256(pickle((parent digest or NONE_HASH, tokens,
    extra_keys))). Extra keys carry the LoRA name on every block and the salt on the block at token 0."""
    out = VllmHashes()
    prev = parent
    for i in range(len(token_ids) // block_size):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        extra = extra_keys_for(start_token + i * block_size, cache_salt=cache_salt, lora_name=lora_name)
        digest = hashlib.sha256(pickle.dumps((prev or none_hash, tokens, extra), protocol=5)).digest()
        out.digests.append(digest)
        out.ids.append(int.from_bytes(digest[-8:], "big"))
        prev = digest
    return out


def extra_keys_for(
    start_token: int, *, cache_salt: str | None = None, lora_name: str | None = None
) -> tuple[Any, ...] | None:
    """One block's extra keys as vLLM publishes them (untagged): the LoRA name, then the salt on the
    block that starts at token 0."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and start_token == 0:
        keys.append(cache_salt)
    return tuple(keys) or None
