"""Block hashing (contract 1): the ONE function gateway and engine both use to name KV blocks.

Token ids are cut into full blocks of ``block_size`` tokens; a partial tail block is never hashed. Each
block's hash is xxh3-64 of its token ids (uint32, little endian) seeded with its parent's hash, so a hash
names the whole prefix up to and including its block. The first block is seeded from a namespace (model,
tenant cache salt, adapter): equal text under two namespaces never shares a hash.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

TokenIds = Sequence[int] | np.ndarray
BlockHash = int

_NAMESPACE_VERSION = b"kvgate-block-hash/v1"


def namespace_seed(model: str, cache_salt: str = "", adapter: str = "") -> int:
    """The chain's root: identical prompts hash alike only under the same model, salt and adapter."""
    parts = (_NAMESPACE_VERSION, model.encode(), cache_salt.encode(), adapter.encode())
    # Length-prefix each part so that ("ab", "c") and ("a", "bc") cannot collide.
    blob = b"".join(len(p).to_bytes(4, "little") + p for p in parts)
    return xxhash.xxh3_64_intdigest(blob)


@functools.lru_cache(maxsize=4096)
def cached_namespace_seed(model: str, cache_salt: str = "") -> int:
    """``namespace_seed`` remembered for the namespaces in use. Bounded on purpose: clients choose salts
    (vLLM's ``cache_salt`` is per request: one per end user, or a new one each time), and a memo kept
    for every salt ever seen grew without end."""
    return namespace_seed(model, cache_salt)


def token_bytes(token_ids: TokenIds) -> bytes:
    """Token ids as the little-endian uint32 bytes that are hashed; rejects ids outside [0, 2**32)."""
    if len(token_ids) == 0:
        return b""
    try:
        arr = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids)
    except (OverflowError, ValueError) as exc:  # ints beyond 64 bits, ragged nesting
        raise ValueError("token ids must be integers in [0, 2**32)") from exc
    if arr.dtype == np.dtype("<u4"):
        return arr.tobytes()
    if arr.dtype.kind not in "iu" or arr.ndim != 1:
        raise ValueError("token ids must be a flat sequence of integers")
    if arr.min() < 0 or arr.max() >= 2**32:
        raise ValueError("token ids must lie in [0, 2**32)")
    return arr.astype("<u4").tobytes()


def hash_block(parent: int, block_token_bytes: bytes | memoryview) -> BlockHash:
    """The hash of one full block, chained on its parent's hash (or the namespace seed)."""
    return xxhash.xxh3_64_intdigest(block_token_bytes, seed=parent)


def block_hashes(
    token_ids: TokenIds, block_size: int, seed: int, *, parent: int | None = None
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids``, in order.

    ``parent`` continues an existing chain (the hash of the block before ``token_ids[0]``); without it the
    chain starts at ``seed``. The loop runs once per block, never per token.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    data = token_bytes(token_ids)
    stride = block_size * 4
    end = len(data) // stride * stride
    digest = xxhash.xxh3_64_intdigest  # positional seed: measurably faster than seed=
    h = seed if parent is None else parent
    out: list[BlockHash] = []
    append = out.append
    for i in range(0, end, stride):
        h = digest(data[i : i + stride], h)
        append(h)
    return out


def to_hex(block_hash: BlockHash) -> str:
    """A block hash as 16 hex digits: the form used in Redis keys (Lua numbers lose 64-bit precision)."""
    return f"{block_hash:016x}"


class PrefixHashMemo:
    """``block_hashes`` with a memory: a prompt that repeats a known prefix is hashed from there on.

    Prompts repeat (every turn of a conversation resends the last one; agents resend long system prompts),
    and chaining costs a Python call per block. The memo keeps the chain in segments of ``every`` blocks,
    keyed by a 128-bit hash of all token bytes up to the segment's end, which one streaming pass over the
    prompt computes at C speed. The result is always exactly ``block_hashes(...)``.
    """

    def __init__(self, every: int = 32, max_segments: int = 20_000) -> None:
        if every < 1 or max_segments < 1:
            raise ValueError("every and max_segments must be positive")
        self.every = every
        self.max_segments = max_segments
        self._segments: OrderedDict[tuple[int, int, int], tuple[int, ...]] = OrderedDict()
        self.hits = 0  # segments reused rather than recomputed

    def __len__(self) -> int:
        return len(self._segments)

    def block_hashes(self, token_ids: TokenIds, block_size: int, seed: int) -> list[BlockHash]:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        data = token_bytes(token_ids)
        span = block_size * 4 * self.every
        checkpoints = len(data) // span
        if not checkpoints:
            return block_hashes(data_view(data), block_size, seed)
        stream = xxhash.xxh3_128(seed=seed)
        keys = []
        for i in range(checkpoints):
            stream.update(data[i * span : (i + 1) * span])
            keys.append((block_size, seed, stream.intdigest()))
        out: list[BlockHash] = []
        segments = self._segments
        done = 0
        for key in keys:
            segment = segments.get(key)
            if segment is None:
                break
            segments.move_to_end(key)
            out.extend(segment)
            done += 1
        self.hits += done
        parent = out[-1] if out else None
        rest = block_hashes(data_view(data[done * span :]), block_size, seed, parent=parent)
        for i in range(done, checkpoints):
            segment = tuple(rest[(i - done) * self.every : (i - done + 1) * self.every])
            segments[keys[i]] = segment
        while len(segments) > self.max_segments:
            segments.popitem(last=False)
        out.extend(rest)
        return out


def data_view(data: bytes) -> np.ndarray:
    """Already-encoded token bytes as the uint32 array ``block_hashes`` accepts without copying."""
    return np.frombuffer(data, dtype="<u4")


def shared_boundary_seed(last_shared_hash: int, private_seed: int) -> int:
    """Where a tenant's own chain starts after a shared public prefix: mixes the tenant's namespace in, so
    two tenants' continuations of the same public prefix still never share a hash."""
    return xxhash.xxh3_64_intdigest(last_shared_hash.to_bytes(8, "little"), seed=private_seed)


def public_blocks(shared_blocks: int, private_seed: int, public_seed: int | None) -> int:
    """How many leading blocks really hash in the public namespace: none without one, or when the
    tenant's namespace is the public one (no salt: everything is one namespace already)."""
    return (
        shared_blocks if shared_blocks > 0 and public_seed is not None and public_seed != private_seed else 0
    )


def chain_parent(
    hashes: Sequence[BlockHash], shared_blocks: int, private_seed: int, public_seed: int | None
) -> int | None:
    """What the block after ``hashes`` (a ``namespaced_block_hashes`` chain) continues from, as ``parent``:
    the last hash, or the tenant's boundary seed right after a shared public prefix."""
    if not hashes:
        return None
    shared_blocks = public_blocks(shared_blocks, private_seed, public_seed)
    if shared_blocks and len(hashes) == shared_blocks:
        return shared_boundary_seed(hashes[-1], private_seed)
    return hashes[-1]


Hasher = Callable[[TokenIds, int, int], list[BlockHash]]


def namespaced_block_hashes(
    token_ids: TokenIds,
    block_size: int,
    private_seed: int,
    *,
    public_seed: int | None = None,
    shared_blocks: int = 0,
    hasher: Hasher | None = None,
) -> list[BlockHash]:
    """Block hashes whose first ``shared_blocks`` blocks live in the public namespace (an operator-declared
    prefix every tenant may share) and the rest in the tenant's. Without a shared part: ``block_hashes``."""
    hash_fn: Hasher = hasher or (lambda ids, bs, seed: block_hashes(ids, bs, seed))
    shared_blocks = public_blocks(shared_blocks, private_seed, public_seed)
    if not shared_blocks or public_seed is None:  # (the second only tells the type checker)
        return hash_fn(token_ids, block_size, private_seed)
    cut = shared_blocks * block_size
    head = hash_fn(token_ids[:cut], block_size, public_seed)
    if len(head) < shared_blocks:
        return head
    return head + hash_fn(token_ids[cut:], block_size, shared_boundary_seed(head[-1], private_seed))
