"""argparse types shared by the engine's subcommands: each refuses an out-of-range value with its reason."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must lie in [0, 65535], got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 <= value < float("inf"):  # refuses NaN, and inf: a cost of inf seconds waits forever
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A share of something, in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
