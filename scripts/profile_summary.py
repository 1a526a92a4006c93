"""Prints what a profiled recipe step spent its time on, from the torch profiler's trace.

Usage:
    python scripts/profile_summary.py PATH [--gap-ms 1.0] [--longest 10]

PATH is a trace (``*.json`` or ``*.json.gz``) or a folder to take the newest one from, such as a
run's ``profiler.output_dir``; a run writes one with ``profiler.enabled=True`` (see
docs/benchmarks.md, "Profiling a step"). Prints, per profiled step: the device's kernels and copies
(the union over streams), the time no kernel ran and what the training thread was in meanwhile,
and the engine's ``offload/...`` ranges on each thread. See
:mod:`torchtune_offload.bench.trace_summary`.
"""

import argparse
import sys
from typing import List

from torchtune_offload.bench.arguments import non_negative_number, positive_int
from torchtune_offload.bench.trace_summary import format_summary, summarize


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a trace file, or a folder holding traces (the newest is read)")
    parser.add_argument("--gap-ms", type=non_negative_number, default=1.0,
                        help="shortest stretch without kernels listed as a gap (default 1.0 ms)")
    parser.add_argument("--longest", type=positive_int, default=10, help="how many of the longest gaps to list")
    args = parser.parse_args(argv)
    try:
        print(format_summary(summarize(args.path, gap_ms=args.gap_ms, num_longest=args.longest)))
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(str(err)) from err


if __name__ == "__main__":
    main(sys.argv[1:])
