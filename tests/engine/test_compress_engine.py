"""The engine on compressed weights: a compressed checkpoint and weights kept compressed in memory give the
uncompressed engine's logits bit for bit and its greedy tokens; the palette form and its Triton kernel
expand every weight exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.attention import KVCache, SeqSlice, build_metadata
from engine.compress import codec
from engine.compress.checkpoint import compress_checkpoint
from engine.compress.in_memory import keep_compressed
from engine.compress.palette import ESCAPE, compress, expand_native, expand_reference
from engine.kernels.triton_support import interpreter_usable
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model.errors import ModelLoadError
from engine.model.llama import CausalLM
from engine.model.loader import load_model
from engine.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny-bf16", "tiny", seed=2, dtype="bfloat16")


@pytest.fixture(scope="module")
def compressed_model(bf16_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("compressed") / "tiny-bf16"
    compress_checkpoint(bf16_model, target)
    return target


def prompts(vocab: int) -> list[list[int]]:
    return [[(5 * i + 11 * j + 1) % vocab for j in range(n)] for i, n in enumerate((6, 13, 3))]


def logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` then decode one more, through the paged cache: both steps' logits [T + 1, V]."""
    config = model.config
    cache = KVCache(
        config.num_hidden_layers, 8, BLOCK, config.num_key_value_heads, config.head_dim, torch.bfloat16
    )
    table = list(range(8))
    ids = torch.tensor(tokens)
    out = [
        model.compute_logits(
            model(ids, torch.arange(len(ids)), cache, build_metadata([SeqSlice(table, 0, len(ids))], BLOCK))
        )
    ]
    nxt = out[0][-1:].argmax(-1)
    meta = build_metadata([SeqSlice(table, len(ids), 1)], BLOCK)
    out.append(model.compute_logits(model(nxt, torch.tensor([len(ids)]), cache, meta)))
    return torch.cat(out)


def engine(model_dir: Path, **options: object) -> LLMEngine:
    config = EngineConfig(str(model_dir), device="cpu", block_size=BLOCK, num_kv_blocks=64, **options)  # type: ignore[arg-type]
    return LLMEngine(config)


@torch.inference_mode()
def test_a_compressed_checkpoint_gives_bit_equal_logits(bf16_model: Path, compressed_model: Path) -> None:
    original, config = load_model(bf16_model)
    loaded, _ = load_model(compressed_model)
    tokens = prompts(config.vocab_size)[1]
    assert torch.equal(logits(original, tokens), logits(loaded, tokens))


def test_a_compressed_checkpoint_gives_the_same_greedy_tokens(
    bf16_model: Path, compressed_model: Path
) -> None:
    reference = engine(bf16_model)
    ps = prompts(reference.model_config.vocab_size)
    assert engine(compressed_model).generate(ps, GREEDY) == reference.generate(ps, GREEDY)


@torch.inference_mode()
def test_weights_kept_compressed_give_bit_equal_logits(bf16_model: Path) -> None:
    original, config = load_model(bf16_model)
    held, _ = load_model(bf16_model)
    layers = keep_compressed(held, min_elements=1)  # every matrix and norm, to test them all
    assert layers.forms and all(p.data_ptr() != 0 for p in held.parameters())
    buffer = layers.buffer.untyped_storage().data_ptr()
    shared = [p for n, p in held.named_parameters() if n.startswith("model.layers.")]
    assert all(p.untyped_storage().data_ptr() == buffer for p in shared)  # the BF16 copies are gone
    tokens = prompts(config.vocab_size)[0]
    assert torch.equal(logits(original, tokens), logits(held, tokens))


def test_the_engine_option_gives_the_same_greedy_tokens(bf16_model: Path, compressed_model: Path) -> None:
    reference = engine(bf16_model)
    ps = prompts(reference.model_config.vocab_size)
    expected = reference.generate(ps, GREEDY)
    assert engine(bf16_model, compressed_weights=True).generate(ps, GREEDY) == expected
    assert engine(compressed_model, compressed_weights=True).generate(ps, GREEDY) == expected


def test_the_engine_option_needs_bfloat16_weights(bf16_model: Path) -> None:
    with pytest.raises(ModelLoadError, match="no bfloat16 weights"):
        engine(bf16_model, dtype="float32", compressed_weights=True)


def spread_weights(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Values over ~40 binades, so that many high bytes fall outside the 15-entry palette."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.logspace(-12, 12, shape[-1])).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(1,), (7,), (33, 17), (64, 128)])
def test_palette_form_expands_bit_for_bit(shape: tuple[int, ...]) -> None:
    weight = spread_weights(shape)
    form = compress(weight)
    if weight.numel() > 100:
        assert 0 < form.exception_index.numel() < weight.numel()  # both paths of the expansion run
    out = torch.full_like(weight, float("nan"))
    expand_reference(form, out)
    assert torch.equal(out.view(torch.int16), weight.view(torch.int16))


@pytest.mark.skipif(not codec.native_available(), reason="the _rans extension is not built")
@pytest.mark.parametrize("shape", [(1,), (9,), (33, 17)])
def test_native_cpu_expansion_matches_the_reference(shape: tuple[int, ...]) -> None:
    weight = spread_weights(shape, seed=4)
    form = compress(weight)
    out = torch.zeros_like(weight)
    assert expand_native(form, out) is out
    assert torch.equal(out.view(torch.int16), weight.view(torch.int16))


def test_palette_form_of_real_like_weights_is_a_third_smaller() -> None:
    weight = (torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    form = compress(weight)
    assert int((form.codes & 15).max()) <= ESCAPE
    assert 1.30 < weight.numel() * 2 / form.nbytes < 1.34


def test_palette_form_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="bfloat16"):
        compress(torch.zeros(8))


@pytest.mark.skipif(
    not interpreter_usable(), reason="Triton's interpreter is not usable (see tests/triton_interpret.py)"
)
@pytest.mark.parametrize("shape", [(5,), (40, 37)])
def test_triton_kernel_matches_the_reference(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.compress.triton_expand import expand, expand_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    weight = spread_weights(shape, seed=3)
    form = compress(weight)
    out = torch.zeros_like(weight)
    expand_triton(form, out)
    assert torch.equal(out.view(torch.int16), weight.view(torch.int16))
    again = torch.zeros_like(weight)
    assert expand(form, again) is again and torch.equal(again.view(torch.int16), weight.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        expand_triton(form, torch.zeros(shape))
