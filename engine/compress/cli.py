"""``kvgate compress`` and ``kvgate decompress``: model directory <-> its lossless compressed copy."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.cli_args import positive_int

COMPRESS_HELP = (
    "losslessly compress a model directory's safetensors weights (BF16/F16/F32, ~1.5x for BF16) into a "
    "directory the engine loads directly"
)
DECOMPRESS_HELP = "write back the original model directory (the same safetensors bytes) from a compressed one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="IN_DIR", help="the model directory to read")
    parser.add_argument("target", metavar="OUT_DIR", help="where to write (created if needed)")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="coding threads (default: all cores)"
    )
    parser.add_argument("--force", action="store_true", help="write into OUT_DIR even if it is not empty")


def run_compress(args: argparse.Namespace) -> int:
    return _run(args, "compress")


def run_decompress(args: argparse.Namespace) -> int:
    return _run(args, "decompress")


def _run(args: argparse.Namespace, command: str) -> int:
    from engine.compress.checkpoint import compress_checkpoint, decompress_checkpoint
    from engine.model.errors import ModelLoadError

    target = Path(args.target)
    if target.exists() and (not target.is_dir() or (any(target.iterdir()) and not args.force)):
        print(f"kvgate {command}: {target} exists and is not an empty directory (--force writes into it)",
              file=sys.stderr)  # fmt: skip
        return 1
    job = compress_checkpoint if command == "compress" else decompress_checkpoint
    try:
        report = job(args.source, target, threads=args.threads, bar=True)
    except ModelLoadError as exc:  # a bad or corrupt input: the message names the file, tensor and chunk
        print(f"kvgate {command}: {exc}", file=sys.stderr)
        return 2
    mb = 1e6
    print(
        f"{command}ed {args.source} -> {target}: {report.tensors} tensors in {report.files} file(s), "
        f"{report.original_bytes / mb:.1f} MB <-> {report.compressed_bytes / mb:.1f} MB "
        f"({report.ratio:.3f}x) in {report.seconds:.2f} s"
    )
    return 0
