"""``kvgate make-model``: write a random-weight model in the Hugging Face layout (nothing is downloaded)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli_args import non_negative_int

MAKE_MODEL_HELP = (
    "write a RANDOM-weight model (Hugging Face layout, with a tokenizer) for tests and demos; "
    "nothing is downloaded and its output is meaningless text"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR", help="where to write the model (created if needed)")
    parser.add_argument(
        "--preset",
        choices=("tiny", "small"),
        required=True,
        help="tiny: ~0.1M parameters, for fast tests; small: ~88M parameters",
    )
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama", help="(default: %(default)s)")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="the same seed writes the same bytes (default: 0)"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="(default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")


def run_make_model(args: argparse.Namespace) -> int:
    """Write the random model; returns the exit status."""
    directory = Path(args.directory)
    if directory.exists() and (not directory.is_dir() or (any(directory.iterdir()) and not args.force)):
        print(
            f"kvgate make-model: {directory} exists and is not an empty directory (--force writes into it)",
            file=sys.stderr,
        )
        return 1
    print(
        "kvgate make-model: the weights are RANDOM (nothing is downloaded): the model runs, "
        "but its output is meaningless text."
    )
    from engine.make_model import count_parameters, make_model
    from engine.model.config import ModelConfig

    make_model(
        directory,
        args.preset,
        arch=args.arch,
        seed=args.seed,
        dtype=args.dtype,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
        bar=True,
    )
    config = ModelConfig.from_dir(directory)
    print(
        f"wrote {directory}: {config.architecture}, preset {args.preset}, {count_parameters(config):,} "
        f"RANDOM parameters, vocab {config.vocab_size}, {args.dtype}, seed {args.seed}"
    )
    return 0
