"""Prints the loss curves and a tok/s + memory summary of recipe runs, side by side.

Usage:
    python scripts/compare_runs.py NAME=OUTPUT_DIR [NAME=OUTPUT_DIR ...]

Reads each run's DiskLogger file (``OUTPUT_DIR/logs/log_*.txt``, the newest if several).
"""

import argparse
import glob
import os
import re
import statistics
import sys
from typing import Dict, List

LINE = re.compile(r"^Step (\d+) \| (.*)$")


def read_log(output_dir: str) -> List[Dict[str, float]]:
    """One dict of metrics per logged step, from the newest log in ``output_dir/logs``."""
    files = sorted(glob.glob(os.path.join(output_dir, "logs", "log_*.txt")), key=os.path.getmtime)
    if not files:
        raise SystemExit(f"no log_*.txt under {output_dir}/logs: did the run finish?")
    steps = []
    with open(files[-1]) as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                metrics = dict(kv.split(":", 1) for kv in m.group(2).split())
                steps.append({"step": int(m.group(1)), **{k: float(v) for k, v in metrics.items()}})
    return steps


def sparkline(values: List[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values)


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="NAME=OUTPUT_DIR pairs")
    args = parser.parse_args(argv)
    runs = {}
    for spec in args.runs:
        if "=" not in spec:
            parser.error(f"{spec!r}: expected NAME=OUTPUT_DIR")
        name, path = spec.split("=", 1)
        runs[name] = read_log(path)

    names = list(runs)
    num = min(len(v) for v in runs.values())
    print("\nLoss per step")
    print("step  " + "  ".join(f"{n:>14}" for n in names))
    for i in range(num):
        print(f"{runs[names[0]][i]['step']:>4}  " + "  ".join(f"{runs[n][i]['loss']:>14.6f}" for n in names))
    for n in names:
        print(f"{n:>14}: {sparkline([s['loss'] for s in runs[n]])}")
    if len(names) > 1:
        diff = max(abs(runs[n][i]["loss"] - runs[names[0]][i]["loss"]) for n in names[1:] for i in range(num))
        print(f"largest loss difference from {names[0]}: {diff:.3g}")

    print("\nSummary (tok/s: median over steps after the first; memory in GiB, peaks over the run)")
    keys = ["peak_memory_alloc", "peak_memory_reserved", "nvml_device_used_peak", "host_rss_peak",
            "optimizer_host", "optimizer_device_saved"]
    present = [k for k in keys if any(k in s for r in runs.values() for s in r)]
    print(f"{'run':>14}  {'tok/s':>9}  {'first loss':>10}  {'last loss':>9}  " + "  ".join(f"{k:>22}" for k in present))
    for n, steps in runs.items():
        tps = statistics.median(s["tokens_per_second"] for s in steps[1:] or steps)
        cells = [f"{max(s.get(k, 0.0) for s in steps):>22.4f}" for k in present]
        print(f"{n:>14}  {tps:>9.0f}  {steps[0]['loss']:>10.4f}  {steps[-1]['loss']:>9.4f}  " + "  ".join(cells))


if __name__ == "__main__":
    main(sys.argv[1:])
