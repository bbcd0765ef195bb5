"""The ``.kvgate`` weights file: chunk payloads, then a manifest, then a fixed footer; every part checksummed.

Layout: ``MAGIC`` | payloads | manifest (zlib-compressed JSON) | footer = manifest length (u64 LE), the
manifest's xxh3-64 (u64 LE), ``MAGIC``. The manifest names each tensor (dtype, shape, codec, frequency
table) and each of its chunks (offset, element count, stream and rest lengths, xxh3-64 of the payload).
Offsets count from the start of the file. A truncated or damaged file fails with ``CorruptWeightsError``
naming the file, the tensor and the chunk.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import xxhash

from engine.model.errors import ModelLoadError

MAGIC = b"KVGATEW1"
FORMAT = "kvgate-weights"
VERSION = 2  # 2: 32-bit rANS states, 16-bit words, 16 lanes (1: 64-bit states, 32-bit words, 8 lanes)
_FOOTER = struct.Struct("<QQ8s")


class CorruptWeightsError(ModelLoadError):
    """A compressed weights file that is damaged, truncated, or not one at all."""


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class Chunk:
    offset: int  # from the start of the file
    count: int  # elements
    stream_len: int  # bytes of rANS stream (0 for raw and const tensors)
    rest_len: int  # bytes stored as they are after the stream
    checksum: int  # xxh3-64 of the stream and rest bytes

    @property
    def size(self) -> int:
        return self.stream_len + self.rest_len


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # safetensors' name: "BF16", "F32", "I64", ...
    shape: tuple[int, ...]
    codec: str  # "rans": exponent stream + raw rest; "const": one exponent + raw rest; "raw": the bytes
    chunks: tuple[Chunk, ...]
    freqs: dict[int, int] = field(default_factory=dict)  # rans: symbol -> frequency out of 4096
    symbol: int = 0  # const: the one symbol

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "codec": self.codec}
        if self.codec == "rans":
            out["freqs"] = [[s, f] for s, f in sorted(self.freqs.items())]
        if self.codec == "const":
            out["symbol"] = self.symbol
        out["chunks"] = [[c.offset, c.count, c.stream_len, c.rest_len, c.checksum] for c in self.chunks]
        return out

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> TensorEntry:
        return cls(
            name=name,
            dtype=str(data["dtype"]),
            shape=tuple(int(d) for d in data["shape"]),
            codec=str(data["codec"]),
            chunks=tuple(Chunk(*(int(v) for v in c)) for c in data["chunks"]),
            freqs={int(s): int(f) for s, f in data.get("freqs", [])},
            symbol=int(data.get("symbol", 0)),
        )


class Writer:
    """Append chunk payloads, then ``finish`` with the tensor entries: the manifest goes last."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO = path.open("wb")
        self._file.write(MAGIC)
        self._offset = len(MAGIC)

    def append(self, count: int, stream: bytes, rest: bytes | memoryview) -> Chunk:
        chunk = Chunk(self._offset, count, len(stream), len(rest), _checksum2(stream, rest))
        self._file.write(stream)
        self._file.write(rest)
        self._offset += chunk.size
        return chunk

    def finish(self, entries: list[TensorEntry], extra: dict[str, Any]) -> int:
        """Write the manifest and footer, close the file; returns its size in bytes."""
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            **extra,
            "tensors": {e.name: e.to_json() for e in entries},
        }
        blob = zlib.compress(json.dumps(manifest, separators=(",", ":")).encode(), 9)
        self._file.write(blob)
        self._file.write(_FOOTER.pack(len(blob), checksum(blob), MAGIC))
        self._file.close()
        return self._offset + len(blob) + _FOOTER.size

    def abort(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class Reader:
    """An open ``.kvgate`` file; ``payload`` reads a chunk (positioned reads: threads share the handle and
    no page faults are taken one page at a time, as with a mapping) and verifies it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd = os.open(path, os.O_RDONLY)
            self.size = os.fstat(self._fd).st_size
        except OSError as exc:
            raise CorruptWeightsError(f"{path}: cannot read the compressed weights file: {exc}") from None
        self._scratch = threading.local()
        try:
            self.manifest = self._read_manifest()
        except BaseException:
            os.close(self._fd)
            raise
        try:
            self.entries = {
                name: TensorEntry.from_json(name, data) for name, data in self.manifest["tensors"].items()
            }
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CorruptWeightsError(f"{path}: the manifest is malformed: {exc!r}") from None

    def _read_manifest(self) -> dict[str, Any]:
        size = self.size
        if size < len(MAGIC) + _FOOTER.size or os.pread(self._fd, len(MAGIC), 0) != MAGIC:
            raise CorruptWeightsError(f"{self.path}: not a kvgate compressed weights file (no {MAGIC!r})")
        length, digest, end = _FOOTER.unpack(os.pread(self._fd, _FOOTER.size, size - _FOOTER.size))
        if end != MAGIC or length > size - len(MAGIC) - _FOOTER.size:
            raise CorruptWeightsError(f"{self.path}: no valid footer: the file is truncated or damaged")
        blob = os.pread(self._fd, length, size - _FOOTER.size - length)
        if checksum(blob) != digest:
            raise CorruptWeightsError(f"{self.path}: the manifest's checksum does not match: corrupt file")
        try:
            manifest = json.loads(zlib.decompress(blob))
        except (zlib.error, ValueError) as exc:
            raise CorruptWeightsError(f"{self.path}: the manifest cannot be read: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise CorruptWeightsError(f"{self.path}: not a {FORMAT} manifest")
        if manifest.get("version") != VERSION:
            raise CorruptWeightsError(
                f"{self.path}: format version {manifest.get('version')!r}; this kvgate reads {VERSION}"
            )
        return manifest

    def payload(self, entry: TensorEntry, index: int) -> tuple[memoryview, memoryview]:
        """(stream, rest) bytes of chunk ``index`` of ``entry``, in a buffer of their own, after checking
        they are what was written."""
        view = self.window(entry, index, index + 1, scratch=False)
        stream_len = entry.chunks[index].stream_len
        return view[:stream_len], view[stream_len:]

    def window(self, entry: TensorEntry, first: int, last: int, *, scratch: bool = True) -> memoryview:
        """The payloads (each: stream, then rest bytes) of chunks ``first`` to ``last - 1`` of ``entry``,
        consecutive in the file, in one read, each checked against its checksum. With ``scratch`` they are
        read into this thread's reusable buffer (no fresh pages to fault in) and stay valid only until the
        thread's next scratch read."""
        chunks = entry.chunks[first:last]
        start, end = chunks[0].offset, chunks[-1].offset + chunks[-1].size
        if start < len(MAGIC) or end > self.size - _FOOTER.size:
            where = self.describe(entry, first)
            raise CorruptWeightsError(f"{where} lies outside the file's data: truncated or damaged file")
        if scratch:
            view: memoryview | None = getattr(self._scratch, "view", None)
            if view is None or len(view) < end - start:
                view = self._scratch.view = memoryview(bytearray(max(end - start, 1 << 20)))
            view = view[: end - start]
        else:
            view = memoryview(bytearray(end - start))
        if os.preadv(self._fd, [view], start) != end - start:
            raise CorruptWeightsError(f"{self.describe(entry, first)}: short read: truncated file")
        # Hashing a chunk's contiguous stream and rest bytes in one call gives the writer's two-update digest.
        for index, chunk in enumerate(chunks, start=first):
            lo = chunk.offset - start  # a chunk not where the run says ends up short: a mismatch too
            if checksum(view[lo : lo + chunk.size]) != chunk.checksum:
                where = self.describe(entry, index)
                raise CorruptWeightsError(f"{where}: checksum mismatch: the file is corrupt")
        return view

    def describe(self, entry: TensorEntry, index: int) -> str:
        return f"{self.path}: tensor {entry.name!r} chunk {index + 1}/{len(entry.chunks)}"

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Reader:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _checksum2(stream: bytes | memoryview, rest: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(stream)
    h.update(rest)
    return h.intdigest()
