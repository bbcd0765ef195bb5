"""``kvgate make-model``: a random checkpoint that both transformers and our loader read, byte-identical per
seed, with a tokenizer that round-trips text and knows the ChatML special tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from cache.chat_template import render_chat
from cache.tokens import load_tokenizer
from engine.attention import KVCache, SeqSlice, build_metadata
from engine.cli import register
from engine.make_model import PRESETS, SPECIAL_TOKENS, count_parameters, hf_config_dict, make_model
from engine.make_model_cli import run_make_model
from engine.model.config import ModelConfig
from engine.model.loader import load_model

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "model", "tiny", seed=7)


def kvgate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_writes_the_hugging_face_layout(tiny: Path) -> None:
    assert sorted(p.name for p in tiny.iterdir()) == FILES
    config = ModelConfig.from_dir(tiny)
    tokenizer = load_tokenizer(tiny)
    assert config.vocab_size == tokenizer.vocab_size  # the trained size, not a padded one
    assert config.architecture == "LlamaForCausalLM" and config.hidden_size == 64
    im_end = Tokenizer.from_file(str(tiny / "tokenizer.json")).token_to_id("<|im_end|>")
    assert config.eos_token_id == (im_end,) and tokenizer.eos_token_id == im_end
    assert json.loads((tiny / "generation_config.json").read_text())["eos_token_id"] == im_end
    tokenizer_config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert (
        tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]
    )
    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        norm = f.get_tensor("model.layers.0.input_layernorm.weight")
        proj = f.get_tensor("model.layers.0.mlp.up_proj.weight")
    assert torch.equal(norm, torch.ones(64))
    assert abs(float(proj.std()) - 0.02) < 0.002 and abs(float(proj.mean())) < 0.002


def test_tokenizer_round_trips_and_knows_chatml(tiny: Path) -> None:
    tokenizer = load_tokenizer(tiny)
    for text in [
        "Hello, world!",
        "  leading spaces\tand\ttabs\n\nlines",
        "déjà vu 日本語 🙂 ∑x²",
        "def f(x): ...",
    ]:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
    chat = render_chat([{"role": "user", "content": "hi there"}])
    ids = tokenizer.encode(chat).tolist()
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert all(raw.token_to_id(t) is not None for t in SPECIAL_TOKENS)
    assert ids[0] == raw.token_to_id("<|im_start|>")
    assert ids.count(tokenizer.eos_token_id) == 1  # "<|im_end|>" is one token, not its characters


def test_same_seed_same_bytes(tiny: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", "tiny", seed=7)
    other = make_model(tmp_path / "other", "tiny", seed=8)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.inference_mode()
def test_transformers_and_our_loader_agree(tiny: Path, tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    directory = tiny if arch == "llama" else make_model(tmp_path / arch, "tiny", arch=arch)
    model, config = load_model(directory)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(hf).__name__ == config.architecture
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    cache = KVCache(
        config.num_hidden_layers, 4, 8, config.num_key_value_heads, config.head_dim, torch.float32
    )
    ours = model.compute_logits(
        model(ids, torch.arange(24), cache, build_metadata([SeqSlice([2, 0, 3], 0, 24)], 8))
    )
    torch.testing.assert_close(ours, hf(ids[None]).logits[0].float(), atol=1e-4, rtol=0)
    # transformers' tokenizer reads the same files and renders the same ChatML as the gateway
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == render_chat(messages)
    assert hf_tokenizer.eos_token_id == config.eos_token_id[0]


def test_bfloat16(tmp_path: Path) -> None:
    directory = make_model(tmp_path / "bf16", "tiny", dtype="bfloat16", seed=7)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    model, config = load_model(directory)
    assert config.torch_dtype == "bfloat16" and model.lm_head.weight.dtype == torch.bfloat16


def test_small_preset_size() -> None:
    ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    config = ModelConfig.from_hf(hf_config_dict(PRESETS["small"], "llama", 16_384, ids, "float32"))
    assert config.tie_word_embeddings
    assert count_parameters(config) == 88_099_584
    assert 50_000_000 <= count_parameters(config) <= 100_000_000


def test_cli_says_the_weights_are_random(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = kvgate_parser().parse_args(["make-model", str(tmp_path / "m"), "--preset", "tiny", "--seed", "3"])
    assert args.func is run_make_model
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    assert "RANDOM" in out and "meaningless" in out
    assert "139,584 RANDOM parameters" in out and "vocab 512" in out
    assert "139,584 random weights" in err and "random weights:" in err  # the stages and the bar
    # a non-empty directory is refused unless --force
    assert args.func(args) == 1
    assert "not an empty directory" in capsys.readouterr().err
    forced = kvgate_parser().parse_args(["make-model", str(tmp_path / "m"), "--preset", "tiny", "--force"])
    assert forced.func(forced) == 0


def test_cli_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    parser = kvgate_parser()
    for bad in ([], ["d"], ["d", "--preset", "huge"], ["d", "--preset", "tiny", "--arch", "gpt2"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["make-model", *bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["make-model", "--help"])
    assert "RANDOM" in capsys.readouterr().out
