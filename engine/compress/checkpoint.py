"""Compress and decompress a Hugging Face model directory, and read a compressed one tensor by tensor.

The compressed directory keeps the Hugging Face layout: every file is copied as it is except the safetensors
weights, each of which becomes a ``.kvgate`` file (``model.safetensors`` -> ``model.kvgate``; a sharded
index becomes ``model.kvgate.index.json``). Each ``.kvgate`` file keeps its source's safetensors header, so
``decompress_checkpoint`` writes back the original files byte for byte.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import struct
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from engine.compress.container import CorruptWeightsError, Reader, Writer
from engine.compress.tensors import CHUNK_ELEMENTS, decode_tensor, encode_tensor, nbytes
from engine.model.errors import ModelLoadError

if TYPE_CHECKING:
    import torch

COMPRESSED_FILE = "model.kvgate"
COMPRESSED_INDEX = "model.kvgate.index.json"
SAFETENSORS_INDEX = "model.safetensors.index.json"
SUFFIX = ".kvgate"


@dataclass(frozen=True)
class SafetensorsTensor:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the data section
    end: int


@dataclass(frozen=True)
class Report:
    files: int
    tensors: int
    original_bytes: int  # the safetensors files
    compressed_bytes: int  # the .kvgate files: payloads, manifests, footers
    seconds: float

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.compressed_bytes)


def read_safetensors_header(path: Path) -> tuple[bytes, dict[str, SafetensorsTensor]]:
    """(the header's bytes as stored, length prefix included; its tensors) without reading any data."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            (length,) = struct.unpack("<Q", prefix)
            if length > 100_000_000:
                raise ValueError(f"a header of {length} bytes")
            header = f.read(length)
            parsed = json.loads(header)
        tensors = {
            name: SafetensorsTensor(
                str(d["dtype"]), tuple(int(s) for s in d["shape"]), *(int(o) for o in d["data_offsets"])
            )
            for name, d in parsed.items()
            if name != "__metadata__"
        }
    except (OSError, struct.error, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{path}: not a readable safetensors file: {exc!r}") from None
    for name, t in tensors.items():
        if t.dtype not in _DTYPE_NAMES or t.end - t.begin != nbytes(t.dtype, t.shape):
            raise ModelLoadError(f"{path}: tensor {name} has dtype {t.dtype} and offsets that do not fit")
    return prefix + header, tensors


def source_weight_files(directory: Path) -> list[Path]:
    """The safetensors files the loader would read: ``model.safetensors`` or the shards of its index."""
    from engine.model.loader import weight_files  # the loader imports this module lazily: no cycle

    return weight_files(directory)


def compress_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    threads: int | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    bar: bool = False,
) -> Report:
    """Write the compressed copy of model directory ``src`` into ``dst`` (created; must not be ``src``)."""
    source, target = Path(src), Path(dst)
    if not source.is_dir():
        raise ModelLoadError(f"{source}: no such model directory")
    if target.resolve() == source.resolve():
        raise ModelLoadError(f"{target}: compress into another directory than the model's own")
    files = source_weight_files(source)
    if any(path.suffix == SUFFIX for path in files):
        raise ModelLoadError(f"{source}: already compressed (it holds {files[0].name})")
    headers = [read_safetensors_header(path) for path in files]
    target.mkdir(parents=True, exist_ok=True)
    _copy_others(source, target, skip={p.name for p in files} | {SAFETENSORS_INDEX})
    started = time.perf_counter()
    total = sum(t.end - t.begin for _, tensors in headers for t in tensors.values())
    written, count = 0, 0
    with (
        ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool,
        _bar(total, "compress", bar) as progress,
    ):
        for path, (header, tensors) in zip(files, headers, strict=True):
            writer = Writer(target / (path.name.removesuffix(".safetensors") + SUFFIX))
            try:
                data = _data(path, len(header))
                entries = []
                for name, t in sorted(tensors.items(), key=lambda item: item[1].begin):
                    raw = data[t.begin : t.end]
                    entries.append(
                        encode_tensor(
                            writer, name, t.dtype, t.shape, raw, chunk_elements=chunk_elements, pool=pool
                        )
                    )
                    progress.update(t.end - t.begin)
                source_info = {"file": path.name, "header": base64.b64encode(header).decode()}
                written += writer.finish(entries, {"source": source_info})
                count += len(entries)
            except BaseException:
                writer.abort()
                raise
    if (source / SAFETENSORS_INDEX).is_file():
        index_text = (source / SAFETENSORS_INDEX).read_text(encoding="utf-8")
        weight_map = {
            name: path.name.removesuffix(".safetensors") + SUFFIX
            for path, (_, tensors) in zip(files, headers, strict=True)
            for name in tensors
        }
        index = {"weight_map": weight_map, "source_index": index_text}
        (target / COMPRESSED_INDEX).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
    original = sum(p.stat().st_size for p in files)
    return Report(len(files), count, original, written, time.perf_counter() - started)


def decompress_checkpoint(
    src: str | Path, dst: str | Path, *, threads: int | None = None, bar: bool = False
) -> Report:
    """Write back the original model directory (safetensors files byte for byte) from compressed ``src``."""
    source, target = Path(src), Path(dst)
    files = compressed_weight_files(source)
    if files is None:
        raise ModelLoadError(f"{source}: no {COMPRESSED_FILE} or {COMPRESSED_INDEX}: not a compressed model")
    if target.resolve() == source.resolve():
        raise ModelLoadError(f"{target}: decompress into another directory than the compressed model's")
    target.mkdir(parents=True, exist_ok=True)
    _copy_others(source, target, skip={p.name for p in files} | {COMPRESSED_INDEX})
    started = time.perf_counter()
    readers = [Reader(path) for path in files]
    total = sum(nbytes(e.dtype, e.shape) for r in readers for e in r.entries.values())
    written, count = 0, 0
    try:
        with (
            ThreadPoolExecutor(threads or os.cpu_count() or 1) as pool,
            _bar(total, "decompress", bar) as progress,
        ):
            for reader in readers:
                size, tensors = _write_original(reader, target, pool, progress)
                written, count = written + size, count + tensors
    finally:
        for reader in readers:
            reader.close()
    if (source / COMPRESSED_INDEX).is_file():
        index = _read_index(source)
        (target / SAFETENSORS_INDEX).write_text(str(index["source_index"]), encoding="utf-8")
    compressed = sum(p.stat().st_size for p in files)
    return Report(len(files), count, written, compressed, time.perf_counter() - started)


def compressed_weight_files(directory: Path) -> list[Path] | None:
    """The ``.kvgate`` files of a compressed model directory; None when it is not one."""
    single = directory / COMPRESSED_FILE
    if single.is_file():
        return [single]
    if not (directory / COMPRESSED_INDEX).is_file():
        return None
    names = sorted(set(_read_index(directory)["weight_map"].values()))
    for name in names:
        if not isinstance(name, str) or not (directory / name).is_file():
            raise ModelLoadError(f"{directory / COMPRESSED_INDEX}: file {name!r} is missing from {directory}")
    return [directory / name for name in names]


class CompressedSafetensors:
    """A ``.kvgate`` file behind the part of safetensors' ``safe_open`` handle that the loader uses:
    ``keys()``, ``get_slice(name).get_shape()/.get_dtype()`` and ``get_tensor(name)``. Chunks decode on
    ``threads`` threads (default: every core)."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        self._reader = Reader(path)
        self._pool = ThreadPoolExecutor(threads or os.cpu_count() or 1)

    def keys(self) -> list[str]:
        return list(self._reader.entries)

    def get_slice(self, name: str) -> _Slice:
        entry = self._reader.entries[name]
        return _Slice(entry.shape, entry.dtype, lambda: self.get_tensor(name))

    def get_tensor(self, name: str) -> torch.Tensor:
        import torch

        entry = self._reader.entries[name]
        data = decode_tensor(self._reader, entry, pool=self._pool)
        dtype = getattr(torch, _DTYPE_NAMES[entry.dtype])
        if data.size == 0:  # frombuffer refuses an empty buffer
            return torch.empty(entry.shape, dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(entry.shape)

    def close(self) -> None:
        self._pool.shutdown()
        self._reader.close()

    def __enter__(self) -> CompressedSafetensors:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@dataclass(frozen=True)
class _Slice:
    """Shape and dtype without decoding; indexing decodes the whole tensor (every chunk) and slices it."""

    shape: tuple[int, ...]
    dtype: str
    load: Callable[[], torch.Tensor]

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self.load()[key]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return self.dtype


_DTYPE_NAMES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
    "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


def _data(path: Path, start: int) -> np.ndarray:
    if path.stat().st_size == start:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=start)


def _source(reader: Reader) -> tuple[bytes, dict[str, SafetensorsTensor], str]:
    try:
        info = reader.manifest["source"]
        header = base64.b64decode(info["header"])
        name = Path(str(info["file"])).name
        (length,) = struct.unpack_from("<Q", header)
        parsed = json.loads(header[8 : 8 + length])
        tensors = {
            n: SafetensorsTensor(str(d["dtype"]), tuple(d["shape"]), *d["data_offsets"])
            for n, d in parsed.items()
            if n != "__metadata__"
        }
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        raise CorruptWeightsError(
            f"{reader.path}: the source safetensors header is unreadable: {exc!r}"
        ) from None
    return header, tensors, name


def _write_original(
    reader: Reader, target: Path, pool: ThreadPoolExecutor, progress: tqdm[Any]
) -> tuple[int, int]:
    """Decode ``reader``'s tensors into the safetensors file it came from; returns (bytes, tensors)."""
    header, tensors, name = _source(reader)
    largest = max((nbytes(e.dtype, e.shape) for e in reader.entries.values()), default=0)
    buffer = np.empty(largest, dtype=np.uint8)  # one allocation reused by every tensor
    out_path = target / name
    partial = out_path.with_name(name + ".partial")  # a failed decode leaves no file that looks whole
    with _removed_on_error(partial), partial.open("wb") as out:
        out.write(header)
        for tensor_name, t in sorted(tensors.items(), key=lambda item: item[1].begin):
            entry = reader.entries.get(tensor_name)
            if entry is None or (entry.dtype, entry.shape) != (t.dtype, t.shape):
                raise CorruptWeightsError(
                    f"{reader.path}: tensor {tensor_name!r} differs from its source header"
                )
            out.seek(len(header) + t.begin)
            out.write(decode_tensor(reader, entry, pool=pool, out=buffer).data)
            progress.update(t.end - t.begin)
    partial.replace(out_path)
    return out_path.stat().st_size, len(tensors)


@contextlib.contextmanager
def _removed_on_error(path: Path) -> Iterator[None]:
    try:
        yield
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _read_index(directory: Path) -> dict[str, Any]:
    path = directory / COMPRESSED_INDEX
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(index.get("weight_map"), dict):
            raise ValueError("no 'weight_map'")
    except (OSError, ValueError, AttributeError) as exc:
        raise ModelLoadError(f"{path}: not a compressed index: {exc!r}") from None
    return index  # type: ignore[no-any-return]


def _copy_others(source: Path, target: Path, skip: set[str]) -> None:
    """Everything but the weights, as it is (config, tokenizer, generation config, subfolders)."""
    for item in source.iterdir():
        if item.name in skip:
            continue
        if item.is_dir():
            shutil.copytree(item, target / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, target / item.name)


def _bar(total: int, desc: str, enabled: bool) -> tqdm[Any]:
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not enabled, file=sys.stderr)
