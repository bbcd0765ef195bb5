"""Load a Hugging Face model directory: ``config.json`` plus ``model.safetensors`` or a sharded index.

Every tensor name and shape is checked against the model before any weight is read, so a wrong or
incomplete checkpoint fails fast with a ``ModelLoadError`` that names what is wrong, not halfway through.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.llama import CausalLM
from engine.parallel.distributed import RankPlacement
from engine.parallel.layers import Shard, read_shard, shard_map

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class StoredTensor:
    path: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", ...


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    placement: RankPlacement | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """The model in eval mode on ``device``, in ``dtype`` (default: the config's ``torch_dtype``). With
    ``placement``, one rank's part: the whole checkpoint is checked, only that rank's slices are read."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise ModelLoadError(f"{directory}: no such model directory")
    config = ModelConfig.from_dir(directory)
    dtype = dtype or getattr(torch, config.torch_dtype)
    stored = index_checkpoint(weight_files(directory))

    with torch.device("meta"):  # no memory and no random init: every weight is overwritten below
        model = CausalLM(config, placement).to(dtype)
        whole = model if placement is None else CausalLM(config).to(dtype)
    # a tied lm_head.weight is listed once, as the embedding
    check_names_and_shapes(directory, dict(whole.named_parameters()), stored, config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each parameter new storage, which unties them
    params = dict(model.named_parameters())
    shards = shard_map(model)
    # A last pipeline stage without the embedding reads its tied head from the embedding's tensor.
    source = {name: _tied_source(name, config) for name in params}
    with torch.no_grad():
        for path in sorted({stored[source[name]].path for name in params}):
            names = [name for name in params if stored[source[name]].path == path]
            with _open(path) as f:
                for name in names:
                    params[name].copy_(_read(f, path, source[name], shards.get(name)))
    return model.eval(), config


def _tied_source(name: str, config: ModelConfig) -> str:
    return "model.embed_tokens.weight" if config.tie_word_embeddings and name == "lm_head.weight" else name


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of the checkpoint: the single file, or every shard its index names."""
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    from engine.compress.checkpoint import compressed_weight_files  # `kvgate compress` output

    if (compressed := compressed_weight_files(directory)) is not None:
        return compressed
    index = directory / INDEX_FILE
    if not index.is_file():
        other = sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in directory.glob(pattern))
        hint = f" (found {', '.join(other[:3])}: only safetensors is supported)" if other else ""
        raise ModelLoadError(f"{directory}: no weights, neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{index}: not a safetensors index with a 'weight_map': {exc!r}") from None
    for shard in shards:
        if not isinstance(shard, str) or not (directory / shard).is_file():
            raise ModelLoadError(f"{index}: shard {shard!r} is missing from {directory}")
    return [directory / shard for shard in shards]


def index_checkpoint(paths: list[Path]) -> dict[str, StoredTensor]:
    """Name -> where it is stored, its shape and dtype, read from the file headers only."""
    stored: dict[str, StoredTensor] = {}
    for path in paths:
        with _open(path) as f:
            try:
                for name in f.keys():  # noqa: SIM118  # the handle is not iterable
                    piece = f.get_slice(name)
                    stored[name] = StoredTensor(path, tuple(piece.get_shape()), piece.get_dtype())
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ModelLoadError(f"{path}: corrupt safetensors file: {exc}") from None
    return stored


def check_names_and_shapes(
    directory: Path, params: Mapping[str, torch.Tensor], stored: dict[str, StoredTensor], config: ModelConfig
) -> None:
    ignored = {name for name in stored if name.endswith("rotary_emb.inv_freq")}  # old checkpoints' buffers
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight")  # some tied checkpoints store the copy anyway; the embedding wins
    missing = sorted(set(params) - set(stored))
    if missing:
        raise ModelLoadError(
            f"{directory}: {len(missing)} tensors missing from the checkpoint: {_some(missing)}"
        )
    unexpected = sorted(set(stored) - set(params) - ignored)
    if unexpected:
        raise ModelLoadError(
            f"{directory}: {len(unexpected)} unexpected tensors in the checkpoint (not part of a "
            f"{config.architecture} with this config): {_some(unexpected)}"
        )
    for name, param in params.items():
        entry = stored[name]
        if entry.shape != tuple(param.shape):
            raise ModelLoadError(
                f"{entry.path}: tensor {name} has shape {list(entry.shape)}, "
                f"the config expects {list(param.shape)}"
            )
        if entry.dtype not in FLOAT_DTYPES:
            raise ModelLoadError(
                f"{entry.path}: tensor {name} is {entry.dtype}; quantized weights are not supported"
            )


def _some(names: list[str]) -> str:
    more = f" and {len(names) - 5} more" if len(names) > 5 else ""
    return ", ".join(names[:5]) + more


def _open(path: Path) -> Any:  # safetensors' handle has no public type
    if path.suffix == ".kvgate":  # compressed weights, behind the same handle; errors name the tensor
        from engine.compress.checkpoint import CompressedSafetensors

        return CompressedSafetensors(path)
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError for a bad header, OSError for an unreadable file
        raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from None


def _read(f: Any, path: Path, name: str, shard: Shard | None = None) -> torch.Tensor:
    try:
        return f.get_tensor(name) if shard is None else read_shard(f, name, shard)
    except Exception as exc:
        raise ModelLoadError(f"{path}: cannot read tensor {name}: {exc}") from None
