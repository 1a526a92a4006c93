"""Argument types for the benchmark scripts' command lines, so that a bad number or output path is
refused by argparse, naming its flag, before anything is measured.

Each type is given to ``argparse.ArgumentParser.add_argument(type=...)``: argparse then prints
``argument --threads: invalid positive integer value: '0'`` and exits 2.
"""

import argparse
import math
from pathlib import Path

__all__ = ["positive_int", "positive_number", "non_negative_number", "check_output_file"]


def positive_int(text: str) -> int:
    """An integer >= 1 (threads, steps, repeats, sizes)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give an integer >= 1")
    return value


positive_int.__name__ = "positive integer"  # what argparse names in its message


def positive_number(text: str) -> float:
    """A finite number > 0; ``1e8`` and ``100e6`` are accepted."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number > 0")
    return value


positive_number.__name__ = "positive number"


def non_negative_number(text: str) -> float:
    """A finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a finite number >= 0")
    return value


non_negative_number.__name__ = "non-negative number"


def check_output_file(parser: argparse.ArgumentParser, path: Path, *, flag: str, force: bool) -> None:
    """Refuses (through ``parser.error``, exit 2) an output file that cannot be written, or one that
    exists and would be replaced without ``--force``; called before anything is measured.

    Args:
        parser: the script's parser, whose ``error`` prints the usage and exits.
        path: the file the script will write.
        flag: the option that named it, e.g. ``--json``.
        force: ``--force`` was given: an existing file may be replaced.
    """
    if path.is_dir():
        parser.error(f"{flag} {path}: is a folder; give a file name")
    if not path.parent.is_dir():
        parser.error(f"{flag} {path}: the folder {path.parent} does not exist")
    if path.exists() and not force:
        parser.error(f"{flag} {path}: already exists; pass --force to replace it, or give another name")
