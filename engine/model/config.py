"""``ModelConfig``: what the model needs from a Hugging Face ``config.json``, checked once at load time.

Both spellings transformers has written are read: ``rope_theta`` + ``rope_scaling`` (4.x) and
``rope_parameters`` (5.x); ``torch_dtype`` (4.x) and ``dtype`` (5.x). Defaults for absent keys are the
transformers config classes' own defaults, so a config means the same model here and there.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from engine.model.errors import ModelLoadError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "float16", "bfloat16")
REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling: ``linear`` divides every frequency by ``factor``; ``llama3`` divides
    the low frequencies only and blends the middle band (the ``*_freq_factor`` fields are llama3's)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q/k/v_proj
    o_proj_bias: bool = False  # Llama's attention_bias covers o_proj too; Qwen2's q/k/v bias does not
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ModelLoadError(f"{path}: not a readable JSON file: {exc}") from None
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path}: expected a JSON object, got {type(raw).__name__}")
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Check a parsed ``config.json``; each refusal is a ``ModelLoadError`` starting with ``source``."""

        def fail(why: str) -> NoReturn:
            raise ModelLoadError(f"{source}: {why}")

        architectures = raw.get("architectures")
        if not isinstance(architectures, list) or not architectures:
            fail("no 'architectures' list, so the model type is unknown")
        arch = architectures[0]
        if arch not in ARCHITECTURES:
            fail(f"unsupported architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
        for key in REQUIRED_KEYS:
            if not _is_positive_int(raw.get(key)):
                fail(f"{key!r} is missing or not a positive integer (got {raw.get(key)!r})")

        hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
        kv_heads = raw.get("num_key_value_heads") or heads
        if not _is_positive_int(kv_heads) or heads % kv_heads:
            fail(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads!r}")
        head_dim = raw.get("head_dim")
        if not head_dim:
            if arch == "Qwen3ForCausalLM":
                head_dim = 128  # Qwen3Config's default, whatever the hidden size
            elif hidden % heads:
                fail(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} and no head_dim")
            else:
                head_dim = hidden // heads
        if not _is_positive_int(head_dim) or head_dim % 2:
            fail(f"head_dim must be a positive even integer (got {head_dim!r})")
        if raw.get("hidden_act", "silu") != "silu":
            fail(f"hidden_act {raw.get('hidden_act')!r} is not supported (only 'silu')")
        _check_full_attention(arch, raw, fail)

        theta, scaling = _rope(raw, fail)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype not in DTYPES:
            fail(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else () if eos is None else (eos,)
        if not all(_is_int(t) for t in eos_ids) or not (
            raw.get("bos_token_id") is None or _is_int(raw["bos_token_id"])
        ):
            fail(f"bos_token_id / eos_token_id must be integers (got {raw.get('bos_token_id')!r} / {eos!r})")

        bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=raw["max_position_embeddings"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias={"Qwen2ForCausalLM": True, "MistralForCausalLM": False}.get(arch, bias),
            o_proj_bias=bias and arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"),
            mlp_bias=bool(raw.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: object) -> bool:
    return _is_int(value) and value > 0  # type: ignore[operator]


def _check_full_attention(arch: str, raw: Mapping[str, Any], fail: Callable[[str], NoReturn]) -> None:
    """Refuse sliding-window attention: the paged attention here always sees the whole context."""
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window", 4096)  # MistralConfig's default when the key is absent
        if window is not None and window < raw["max_position_embeddings"]:
            fail(f"sliding-window attention (sliding_window={window}) is not supported")
    if raw.get("use_sliding_window"):
        fail("sliding-window attention (use_sliding_window=true) is not supported")
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        fail(f"only full-attention layers are supported (layer_types has {sorted(set(layer_types))})")


def _rope(raw: Mapping[str, Any], fail: Callable[[str], NoReturn]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` from either spelling; ``rope_scaling`` wins over ``rope_parameters`` as in
    transformers."""
    params: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = raw.get(key)
        if value is not None and not isinstance(value, dict):
            fail(f"{key!r} must be an object, got {value!r}")
        params.update(value or {})
    if any(isinstance(v, dict) for v in params.values()):
        fail("per-layer-type RoPE parameters are not supported")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or theta <= 0:
        fail(f"rope_theta must be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fail(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        fail(f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None

    def number(key: str) -> float:
        value = params.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            fail(f"rope type {rope_type!r} needs a number {key!r} (got {value!r})")
        return float(value)

    if rope_type == "linear":
        return float(theta), RopeScaling("linear", number("factor"))
    original = params.get("original_max_position_embeddings", raw["max_position_embeddings"])
    if not _is_positive_int(original):
        fail(f"original_max_position_embeddings must be a positive integer, got {original!r}")
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if high <= low:
        fail(f"llama3 RoPE needs high_freq_factor > low_freq_factor (got {high} and {low})")
    return float(theta), RopeScaling("llama3", number("factor"), low, high, original)
