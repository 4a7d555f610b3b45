"""Command-line value types shared by every gputaskman command (argparse `type=`): a bad value
is a one-line usage error naming it, never a traceback."""

from __future__ import annotations

import argparse
import math


def positive_seconds(text: str) -> float:
    """A number of seconds above 0 and finite (`--interval`, `--duration`)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0 or math.isinf(v):  # (NaN is not > 0)
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text!r}")
    return v


def positive_count(text: str) -> int:
    """A whole number, 1 or more (`--count`)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more: {text!r}")
    return v


def gpu_index(text: str) -> int:
    """A GPU's index, 0 or more (`--gpu`)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a GPU index: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"GPU index must be 0 or more: {text!r}")
    return v
