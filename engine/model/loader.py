"""Load a Hugging Face model directory: ``config.json`` plus ``model.safetensors`` or a sharded index.

Every tensor name and shape is checked against the model before any weight is read, so a wrong or
incomplete checkpoint fails fast with a ``ModelLoadError`` that names what is wrong, not halfway through.
The checkpoint stays in Hugging Face's layout: its q/k/v and gate/up tensors are read into slices of the
model's merged layers (``checkpoint_pieces``).
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
from engine.parallel.layers import Shard, checkpoint_pieces, checkpoint_shapes, read_shard

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
    check_names_and_shapes(directory, checkpoint_shapes(whole), stored, config)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each parameter new storage, which unties them
    params = dict(model.named_parameters())
    # A last pipeline stage without the embedding reads its tied head from the embedding's tensor.
    sources = [(piece, _tied_source(piece.name, config)) for piece in checkpoint_pieces(model)]
    with torch.no_grad():
        for path in sorted({stored[name].path for _, name in sources}):
            with _open(path) as f:
                for piece, name in sources:
                    if stored[name].path == path:
                        param = params[piece.param]
                        target = param if piece.rows is None else param[piece.rows]
                        target.copy_(_read(f, path, name, piece.shard))
    return model.eval(), config


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An unsharded model's weights under the checkpoint's names (q/k/v and gate/up apart): views of its
    parameters, a tied head once, as the embedding."""
    params = dict(model.named_parameters())
    out = {}
    for piece in checkpoint_pieces(model):
        param = params[piece.param].detach()
        out[piece.name] = param if piece.rows is None else param[piece.rows]
    return out


def load_state_dict(model: CausalLM, state: Mapping[str, torch.Tensor]) -> None:
    """Fill an unsharded ``model`` from a state dict in Hugging Face's layout (a transformers model's
    ``state_dict()``): every tensor must be there with its shape, nothing else (as ``strict=True``)."""
    stored = {name: StoredTensor(Path("<state dict>"), tuple(t.shape), "F32") for name, t in state.items()}
    check_names_and_shapes(Path("<state dict>"), checkpoint_shapes(model), stored, model.config)
    views = checkpoint_state(model)
    with torch.no_grad():
        for name, view in views.items():
            view.copy_(state[name])


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
    directory: Path,
    params: Mapping[str, tuple[int, ...]],  # checkpoint name -> the shape the model expects
    stored: dict[str, StoredTensor],
    config: ModelConfig,
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
    for name, shape in params.items():
        entry = stored[name]
        if entry.shape != shape:
            raise ModelLoadError(
                f"{entry.path}: tensor {name} has shape {list(entry.shape)}, the config expects {list(shape)}"
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
