"""Prints the loss curves and a tok/s + memory summary of recipe runs, side by side.

Usage:
    python scripts/compare_runs.py NAME=OUTPUT_DIR [NAME=OUTPUT_DIR ...]

The same as ``tune-offload compare NAME=OUTPUT_DIR ...``, which an installed package has too: it
reads each run's DiskLogger file (``OUTPUT_DIR/logs/log_*.txt``, the newest if several) with
:func:`torchtune_offload.recipe.read_disk_log`.
"""

import sys

from torchtune_offload.cli import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
