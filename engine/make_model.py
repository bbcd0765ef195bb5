"""Write a RANDOM-weight checkpoint in the Hugging Face layout, for tests and demos where nothing can be
downloaded: config, safetensors weights, generation config, and a byte-level BPE tokenizer trained here.

The weights are noise (normal(0, 0.02), norms 1): the model runs like a real one and its output is
meaningless. Everything is seeded, so one seed always gives the same bytes.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from engine.model.config import ModelConfig
from engine.model.llama import CausalLM
from engine.parallel.layers import checkpoint_shapes

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The ChatML of cache.chat_template.render_chat: transformers' apply_chat_template agrees with the gateway.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INIT_STD = 0.02


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the tokenizer trainer's target; the trained size is what the config gets
    corpus_lines: int  # enough synthetic text for the trainer to reach vocab_size
    max_position_embeddings: int
    tie_word_embeddings: bool


PRESETS = {
    "tiny": Preset(64, 2, 4, 2, 128, 512, 3_000, 4096, tie_word_embeddings=False),
    "small": Preset(768, 12, 12, 4, 2048, 16_384, 20_000, 8192, tie_word_embeddings=True),
}


def make_model(
    directory: str | Path,
    preset: str,
    *,
    arch: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
) -> Path:
    """Write the checkpoint into ``directory`` (created if needed; files of the same names are replaced).
    ``progress`` hears each stage; ``bar`` draws a progress bar of the weights on stderr."""
    if preset not in PRESETS or arch not in ARCHS or dtype not in DTYPES:
        raise ValueError(f"unknown preset {preset!r}, arch {arch!r} or dtype {dtype!r}")
    say = progress or (lambda _: None)
    spec = PRESETS[preset]
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)

    say(f"training the tokenizer (vocab target {spec.vocab_size})")
    tokenizer = train_tokenizer(spec.vocab_size, spec.corpus_lines)
    ids: dict[str, int] = {}
    for token in SPECIAL_TOKENS:
        token_id = tokenizer.token_to_id(token)
        assert token_id is not None, token
        ids[token] = token_id
    hf_config = hf_config_dict(spec, arch, tokenizer.get_vocab_size(), ids, dtype)
    config = ModelConfig.from_hf(hf_config, source="make_model")

    tensors = random_weights(config, seed, DTYPES[dtype], say, bar=bar)
    mib = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    say(f"writing model.safetensors ({mib:.1f} MiB)")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "config.json", hf_config)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
    )
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "unk_token": None,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": spec.max_position_embeddings,
        },
    )
    return out


def count_parameters(config: ModelConfig) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(config).parameters())


def hf_config_dict(
    spec: Preset, arch: str, vocab_size: int, ids: dict[str, int], dtype: str
) -> dict[str, Any]:
    """``config.json`` in the 4.x spelling (``rope_theta``, ``torch_dtype``); transformers 5 reads it too."""
    architecture, model_type = ARCHS[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.hidden_size // spec.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": INIT_STD,
        "use_cache": True,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config["mlp_bias"] = False
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=spec.num_hidden_layers)
    return config


def random_weights(
    config: ModelConfig, seed: int, dtype: torch.dtype, say: Callable[[str], None], *, bar: bool = False
) -> dict[str, torch.Tensor]:
    """normal(0, INIT_STD) for matrices, ones for norms; drawn in float32 in module order, then cast, so a
    seed gives the same weights in either dtype."""
    with torch.device("meta"):
        shapes = list(checkpoint_shapes(CausalLM(config)).items())  # Hugging Face names, q/k/v apart
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    total = sum(math.prod(shape) for _, shape in shapes)
    say(f"generating {total:,} random weights in {len(shapes)} tensors")
    with tqdm(total=total, unit="weight", unit_scale=True, desc="random weights", disable=not bar,
              file=sys.stderr, leave=False) as progress:  # fmt: skip
        for name, shape in shapes:
            if name.endswith("norm.weight"):
                tensor = torch.ones(shape)
            else:
                tensor = torch.empty(shape).normal_(0.0, INIT_STD, generator=generator)
            tensors[name] = tensor.to(dtype).contiguous()
            progress.update(math.prod(shape))
    return tensors


def train_tokenizer(vocab_size: int, corpus_lines: int) -> Tokenizer:
    """A byte-level BPE trained on ``synthetic_corpus``: any text round-trips (every byte is a token), and the
    special tokens are matched whole, so ChatML prompts encode as the gateway expects."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(synthetic_corpus(corpus_lines), trainer)
    return tokenizer


_WORDS = """
the of and to in is it you that he was for on are with as his they be at one have this from or had
by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him
two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find cache token model engine region gateway request prefix block
hash route
"""
_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr"


def synthetic_corpus(lines: int) -> Iterator[str]:
    """Deterministic text: English words and pronounceable pseudo-words in Zipf proportions, with
    punctuation, numbers, a little code and some non-ASCII, so BPE learns merges of every kind."""
    rng = random.Random(20240601)
    onsets = [*_ONSETS.split(), ""]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
    codas = ["n", "r", "s", "t", "l", "m", "nd", "st", "ng", "", "", ""]
    pseudo: set[str] = set()
    while len(pseudo) < 12_000:
        syllables = rng.randint(1, 3)
        pseudo.add(
            "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables))
        )
    lexicon = _WORDS.split() + sorted(pseudo)
    cum_weights = list(itertools.accumulate(1.0 / rank for rank in range(1, len(lexicon) + 1)))
    extras = ["déjà vu", "naïve café", "größer", "日本語", "ñandú", "→", "€5", "🙂"]
    for i in range(lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 20))
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        if rng.random() < 0.1:
            words.append(str(rng.randint(0, 9999)))
        if rng.random() < 0.05:
            words.append(rng.choice(extras))
        line = " ".join(words) + rng.choice(".,!?:;")
        if i % 50 == 0:
            line = f"def {words[0].lower()}(x):\n    return x + {rng.randint(0, 99)}\n"
        yield line


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
