"""Tiny models and tokenizers that tests build for themselves (nothing can be downloaded here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def make_tokenizer_dir(directory: Path) -> Path:
    """A tiny trained BPE tokenizer saved in the Hugging Face layout (no downloads)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello kvgate"] * 50
    tok.train_from_iterator(corpus, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return directory


def make_bos_tokenizer_dir(directory: Path, *, single: str = "<s> $A") -> Path:
    """``make_tokenizer_dir``'s tokenizer with a post-processor that adds special tokens around a text (by
    default a BOS, as Llama's and Mistral's do): what ``add_special_tokens=True`` adds."""
    from tokenizers import AddedToken, processors

    make_tokenizer_dir(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    ids = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in single]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=ids)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def with_bos(model_dir: Path, directory: Path, bos: str = "<|endoftext|>") -> Path:
    """A copy of ``model_dir`` (at ``directory``) whose tokenizer adds ``bos`` before a text, as Llama's does
    (scripts/test-vllm's tiny model's too): what ``add_special_tokens=True`` adds."""
    from tokenizers import processors

    shutil.copytree(model_dir, directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(str(directory / "tokenizer.json"))
    return directory
