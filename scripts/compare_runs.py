"""Prints the loss curves and a tok/s + memory summary of recipe runs, side by side.

Usage:
    python scripts/compare_runs.py NAME=OUTPUT_DIR [NAME=OUTPUT_DIR ...]

Reads each run's DiskLogger file (``OUTPUT_DIR/logs/log_*.txt``, the newest if several) with
:func:`torchtune_offload.recipe.read_disk_log`.
"""

import argparse
import sys
from typing import List

from torchtune_offload.recipe.run_report import compare_runs


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=OUTPUT_DIR pairs")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        if "=" not in spec:
            parser.error(f"{spec!r}: expected NAME=OUTPUT_DIR")
        name, path = spec.split("=", 1)
        runs[name] = path
    try:
        print(compare_runs(runs))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(str(err)) from err


if __name__ == "__main__":
    main(sys.argv[1:])
