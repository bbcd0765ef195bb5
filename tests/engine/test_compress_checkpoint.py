"""Compressed checkpoints: byte-exact round trips of whole model directories (every dtype, shards, odd
tensors), both decoders reading each other's files, and damage detected with an error naming the place."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.cli import main as engine_main
from engine.compress import codec
from engine.compress.checkpoint import (
    COMPRESSED_FILE,
    COMPRESSED_INDEX,
    CompressedSafetensors,
    compress_checkpoint,
    decompress_checkpoint,
)
from engine.compress.container import CorruptWeightsError, Reader
from engine.compress.tensors import decode_tensor
from engine.model.errors import ModelLoadError
from engine.model.loader import load_model


def mixed_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every case the format distinguishes: each float kind over several chunks, a constant tensor, an
    integer tensor, a scalar, an empty tensor, and a float tensor too small to shrink."""
    g = torch.Generator().manual_seed(seed)
    return {
        "bf16": (torch.randn(100, 70, generator=g) * 0.02).to(torch.bfloat16),
        "f16": (torch.randn(3, 1001, generator=g) * 0.05).half(),
        "f32": torch.randn(4099, generator=g) * 1e-3,
        "ones": torch.ones(300, dtype=torch.bfloat16),
        "ids": torch.arange(77, dtype=torch.int64),
        "scalar": torch.tensor(2.5, dtype=torch.float32),
        "empty": torch.zeros(0, 5, dtype=torch.bfloat16),
        "tiny": torch.tensor([1.5, -3.0], dtype=torch.bfloat16),
    }


@pytest.fixture
def mixed_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "mixed"
    directory.mkdir()
    save_file(mixed_tensors(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text('{"model_type": "none"}')
    (directory / "sub").mkdir()
    (directory / "sub" / "notes.txt").write_text("copied as it is")
    return directory


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-bf16", "tiny", seed=1, dtype="bfloat16")


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_every_dtype_and_odd_tensor_round_trips_byte_for_byte(mixed_dir: Path, tmp_path: Path) -> None:
    report = compress_checkpoint(mixed_dir, tmp_path / "c", chunk_elements=2048)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["config.json", COMPRESSED_FILE, "sub"]
    assert report.compressed_bytes == (tmp_path / "c" / COMPRESSED_FILE).stat().st_size
    with Reader(tmp_path / "c" / COMPRESSED_FILE) as reader:
        codecs = {name: entry.codec for name, entry in reader.entries.items()}
        assert len(reader.entries["bf16"].chunks) == 4  # 7000 elements in chunks of 2048
    assert codecs["bf16"] == codecs["f16"] == codecs["f32"] == "rans"
    assert codecs["ones"] == "const" and codecs["ids"] == codecs["tiny"] == "raw"
    decompress_checkpoint(tmp_path / "c", tmp_path / "back")
    same_files(mixed_dir, tmp_path / "back")


def test_the_handle_gives_the_original_tensors(mixed_dir: Path, tmp_path: Path) -> None:
    compress_checkpoint(mixed_dir, tmp_path / "c", chunk_elements=2048, threads=2)
    with CompressedSafetensors(tmp_path / "c" / COMPRESSED_FILE, threads=2) as f:
        assert sorted(f.keys()) == sorted(mixed_tensors())
        for name, tensor in mixed_tensors().items():
            got = f.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
            assert f.get_slice(name).get_shape() == list(tensor.shape)
        assert torch.equal(f.get_slice("f16")[1:, 5:9], mixed_tensors()["f16"][1:, 5:9])


def test_the_numpy_path_writes_and_reads_the_native_format(
    mixed_dir: Path, tmp_path: Path, numpy_path: None
) -> None:
    compress_checkpoint(mixed_dir, tmp_path / "numpy", chunk_elements=2048)
    decompress_checkpoint(tmp_path / "numpy", tmp_path / "numpy-back")
    same_files(mixed_dir, tmp_path / "numpy-back")
    codec.use_native(True)
    if codec.native_available():  # the two paths' files are the same bytes, and each reads the other's
        compress_checkpoint(mixed_dir, tmp_path / "native", chunk_elements=2048)
        same_files(tmp_path / "numpy", tmp_path / "native")


def test_a_sharded_checkpoint_keeps_its_shards_and_index(tmp_path: Path) -> None:
    source = tmp_path / "sharded"
    source.mkdir()
    tensors = mixed_tensors(seed=4)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:4], "model-00002-of-00002.safetensors": names[4:]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(source / shard))
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (source / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    compress_checkpoint(source, tmp_path / "c")
    index = json.loads((tmp_path / "c" / COMPRESSED_INDEX).read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.kvgate", "model-00002-of-00002.kvgate"}
    decompress_checkpoint(tmp_path / "c", tmp_path / "back")
    same_files(source, tmp_path / "back")


def test_a_compressed_bf16_model_is_smaller_and_loads_the_same_weights(
    bf16_model: Path, tmp_path: Path
) -> None:
    report = compress_checkpoint(bf16_model, tmp_path / "c")
    assert report.ratio > 1.45  # random normal weights: ~2.7 bits of exponent + 8 raw bits per 16
    original, _ = load_model(bf16_model)
    loaded, _ = load_model(tmp_path / "c")
    for (name, a), (other, b) in zip(original.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert name == other and a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), name


def corrupt(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_payload_byte_names_the_tensor_and_chunk(mixed_dir: Path, tmp_path: Path) -> None:
    compress_checkpoint(mixed_dir, tmp_path / "c", chunk_elements=2048)
    path = tmp_path / "c" / COMPRESSED_FILE
    with Reader(path) as reader:
        chunk = reader.entries["bf16"].chunks[2]
    corrupt(path, chunk.offset + chunk.stream_len // 2)
    with pytest.raises(CorruptWeightsError, match=r"tensor 'bf16' chunk 3/4: checksum mismatch"):
        decompress_checkpoint(tmp_path / "c", tmp_path / "back")
    assert not (tmp_path / "back" / "model.safetensors").exists()
    assert not (tmp_path / "back" / "model.safetensors.partial").exists()
    with CompressedSafetensors(path) as f:
        assert torch.equal(f.get_tensor("f32"), mixed_tensors()["f32"])  # the other tensors still read
        with pytest.raises(CorruptWeightsError, match="chunk 3/4"):
            f.get_tensor("bf16")


def test_a_flipped_manifest_byte_or_a_cut_file_is_refused(mixed_dir: Path, tmp_path: Path) -> None:
    compress_checkpoint(mixed_dir, tmp_path / "c")
    path = tmp_path / "c" / COMPRESSED_FILE
    intact = path.read_bytes()
    corrupt(path, len(intact) - 40)  # inside the manifest, just before the 24-byte footer
    with pytest.raises(CorruptWeightsError, match="manifest's checksum"):
        Reader(path)
    path.write_bytes(intact[: len(intact) // 2])
    with pytest.raises(CorruptWeightsError, match="truncated"):
        Reader(path)
    path.write_bytes(b"")
    with pytest.raises(CorruptWeightsError, match="not a kvgate compressed weights file"):
        Reader(path)
    path.unlink()
    with pytest.raises(CorruptWeightsError, match="cannot read"):
        Reader(path)


def test_the_loader_reports_damage_as_a_model_load_error(bf16_model: Path, tmp_path: Path) -> None:
    compress_checkpoint(bf16_model, tmp_path / "c")
    path = tmp_path / "c" / COMPRESSED_FILE
    with Reader(path) as reader:
        chunk = reader.entries["model.layers.1.mlp.up_proj.weight"].chunks[0]
    corrupt(path, chunk.offset + chunk.size - 1)  # a raw sign/mantissa byte
    with pytest.raises(
        ModelLoadError, match=r"model.layers.1.mlp.up_proj.weight' chunk 1/1: checksum mismatch"
    ):
        load_model(tmp_path / "c")


def test_cli_compresses_refuses_a_full_target_and_reports_corruption(
    bf16_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert engine_main(["compress", str(bf16_model), str(tmp_path / "c")]) == 0
    assert "x) in" in capsys.readouterr().out
    assert engine_main(["compress", str(bf16_model), str(tmp_path / "c")]) == 1
    assert "not an empty directory" in capsys.readouterr().err
    assert engine_main(["compress", str(tmp_path / "c"), str(tmp_path / "twice")]) == 2
    assert "already compressed" in capsys.readouterr().err
    assert engine_main(["decompress", str(tmp_path / "c"), str(tmp_path / "back")]) == 0
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        bf16_model / "model.safetensors"
    ).read_bytes()
    shutil.rmtree(tmp_path / "back")
    corrupt(tmp_path / "c" / COMPRESSED_FILE, 100)
    assert engine_main(["decompress", str(tmp_path / "c"), str(tmp_path / "back")]) == 2
    assert "checksum mismatch" in capsys.readouterr().err
    assert engine_main(["decompress", str(bf16_model), str(tmp_path / "other")]) == 2
    assert "not a compressed model" in capsys.readouterr().err


def test_tensors_decode_into_a_caller_buffer(mixed_dir: Path, tmp_path: Path) -> None:
    compress_checkpoint(mixed_dir, tmp_path / "c", chunk_elements=2048)
    buffer = np.full(100_000, 0xAA, dtype=np.uint8)
    with Reader(tmp_path / "c" / COMPRESSED_FILE) as reader:
        for name, tensor in mixed_tensors().items():
            got = decode_tensor(reader, reader.entries[name], out=buffer)
            assert got.tobytes() == tensor.reshape(-1).view(torch.uint8).numpy().tobytes(), name
        with pytest.raises(ValueError, match="at least"):
            decode_tensor(reader, reader.entries["f32"], out=buffer[:10])


def test_chunks_tile_each_tensor(mixed_dir: Path, tmp_path: Path) -> None:
    """The file's chunks tile each tensor exactly: element counts add up to the shape."""
    compress_checkpoint(mixed_dir, tmp_path / "c", chunk_elements=1000)
    with Reader(tmp_path / "c" / COMPRESSED_FILE) as reader:
        for name, tensor in mixed_tensors().items():
            entry = reader.entries[name]
            assert sum(c.count for c in entry.chunks) == int(np.prod(tensor.shape)), name
            assert all(c.count <= 1000 for c in entry.chunks)
