"""The planner's predictions beside a sweep's measured peaks, as a markdown table.

Usage (from the repository root):

    python -m torchtune_offload.plan --config CONFIG --json plan.json [--variants ...] [overrides ...]
    python scripts/plan_vs_sweep.py plan.json SWEEP_DIR/results.json

Give the planner the sweep's config, variants and overrides (``scripts/gpu_results.sh`` prints them
in the sweep's table header). The planner traces one step on fake CPU tensors, so it predicts what the
caching allocator hands out (``max_memory_allocated``); NVML also sees the CUDA context, the
allocator's cached reserve and, for bitsandbytes' paged optimizers, their unified memory, which the
planner lists apart ("+ paged"). Host figures are compared with the run's RSS peak.
"""

import argparse
import json
from typing import Any, Dict, Optional

from torchtune_offload.bench.variants import legend

GIB = 1024**3


def _pct(predicted: Optional[float], measured: Optional[float]) -> str:
    if predicted is None or not measured:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.1f}%"


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def table(plans: Dict[str, dict], results: Dict[str, dict]) -> str:
    """One row per variant found in both files; memory in GiB."""
    lines = ["| variant | predicted device | + paged | allocator peak | vs allocator | NVML peak (run) | "
             "predicted device + paged vs NVML | predicted host | host RSS peak | vs RSS |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, plan in plans.items():
        run = results.get(name)
        if run is None or not run.get("peaks_gib"):
            continue
        peaks = run["peaks_gib"]
        device = plan["device_bytes"] / GIB if plan["device_bytes"] is not None else None
        paged = plan["paged_bytes"] / GIB if plan.get("paged_bytes") else 0.0
        host = plan["host_bytes"] / GIB if plan["host_bytes"] is not None else None
        alloc, nvml, rss = peaks.get("peak_memory_alloc"), peaks.get("nvml_run_peak"), peaks.get("host_rss_peak")
        lines.append(
            f"| {name} | {_fmt(device)} | {_fmt(paged) if paged else '-'} | {_fmt(alloc)} | {_pct(device, alloc)} "
            f"| {_fmt(nvml)} | {_pct(None if device is None else device + paged, nvml)} | {_fmt(host)} "
            f"| {_fmt(rss)} | {_pct(host, rss)} |"
        )
    return "\n".join(lines)


def _read(parser: argparse.ArgumentParser, path: str, key: Optional[str]) -> Any:
    """The JSON at ``path``: the planner's (a mapping with ``key``) or a sweep's (a list), else a usage error."""
    what = "python -m torchtune_offload.plan --json" if key else "a sweep's results.json"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        parser.error(f"{path}: cannot be read as JSON ({err})")
    if (key is not None and not (isinstance(data, dict) and key in data)) or (key is None and not isinstance(data, list)):
        parser.error(f"{path}: not what {what} writes (are the two files swapped?)")
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan_json", help="written by python -m torchtune_offload.plan --json")
    parser.add_argument("results_json", help="a sweep's results.json (scripts/benchmark_sweep.py)")
    args = parser.parse_args()
    plans, results = _read(parser, args.plan_json, "plans"), _read(parser, args.results_json, None)
    plans = {p["name"]: p for p in plans["plans"]}
    results = {r["name"]: r for r in results}
    measured = [n for n, r in results.items() if r.get("peaks_gib")]
    both = [n for n in plans if n in measured]
    if not both:
        parser.error(f"no variant is in both files with measured peaks: the plan has {', '.join(plans) or 'none'}, "
                     f"the sweep measured {', '.join(measured) or 'none'}. Plan the sweep's variants "
                     "(--variants) on its config and overrides.")
    print(table(plans, results))
    named = legend(both)
    if named:
        print(named)
    status = {n: r.get("status") for n, r in results.items()}
    left = [f"{n} (not in the sweep)" if n not in results else f"{n} ({status[n] + '; ' if status[n] else ''}no peaks)"
            for n in plans if n not in both]
    if left:
        print(f"\nNot compared: {', '.join(left)}.")


if __name__ == "__main__":
    main()
