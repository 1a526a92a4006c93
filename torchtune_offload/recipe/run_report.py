"""Side-by-side loss curves and a tok/s + memory summary of runs read from their DiskLogger files."""

import math
import statistics
from typing import Dict, List, Mapping, Optional

from torchtune_offload.recipe.disk_log import read_disk_log

#: Memory figures summarised when any run logged them (GiB, peak over the run).
SUMMARY_KEYS = (
    "peak_memory_alloc", "peak_memory_reserved", "nvml_device_used_peak", "host_rss_peak",
    "optimizer_host", "optimizer_device_saved",
)


def median_tokens_per_second(rows: List[Dict[str, float]]) -> float:
    """The run's speed: the median tok/s over its logged steps after the first (warm-up), leaving
    out those the profiler warmed up or recorded (logged ``profiled``), unless every one was.

    Raises:
        ValueError: where no step logged ``tokens_per_second`` (torchtune's own recipes log
            ``tokens_per_second_per_gpu``, which is taken instead).
    """
    rows = rows[1:] or rows
    rows = [r for r in rows if not r.get("profiled")] or rows
    for key in ("tokens_per_second", "tokens_per_second_per_gpu"):
        values = [r[key] for r in rows if key in r]
        if values:
            return statistics.median(values)
    raise ValueError("no logged step has tokens_per_second (nor torchtune's tokens_per_second_per_gpu)")


def peak(rows: List[Dict[str, float]], key: str) -> Optional[float]:
    """The largest value of ``key`` over the logged steps, or None where no step logged it."""
    values = [r[key] for r in rows if key in r]
    return max(values) if values else None


def cell(value: Optional[float], fmt: str) -> str:
    """``value`` formatted, or '-' for a figure a run never logged (not zero)."""
    return "-" if value is None else format(value, fmt)


def sparkline(values: List[float]) -> str:
    """``values`` as one line of block characters, lowest to highest."""
    bars = "▁▂▃▄▅▆▇█"
    # A diverged run's last loss is nan or inf: drawn as '!', the rest scaled without it.
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] if math.isfinite(v) else "!" for v in values)


def run_summary(rows: List[Dict[str, float]]) -> str:
    """One line on a finished run from its logged rows: its median tok/s and its memory peaks.

    Args:
        rows: the metrics the run logged, one dict a logged step (as :func:`read_disk_log` gives them).
    """
    if not rows:
        return "Finished: no step was logged (log_every_n_steps is larger than the run)."
    peaks = [f"{key} {value:.2f}" for key in SUMMARY_KEYS if (value := peak(rows, key)) is not None]
    return (f"Finished: {median_tokens_per_second(rows):.1f} tok/s (median of the logged steps after the first)"
            + (f"; peak memory, GiB: {', '.join(peaks)}" if peaks else "")
            + ". `tune-offload compare NAME=<output_dir> ...` puts runs side by side.")


def compare_runs(output_dirs: Mapping[str, str]) -> str:
    """The comparison of runs, by name, as printable text.

    Args:
        output_dirs: run name -> the run's ``output_dir`` (its newest DiskLogger file is read).
    """
    runs: Dict[str, List[Dict[str, float]]] = {n: read_disk_log(d) for n, d in output_dirs.items()}
    empty = [n for n, rows in runs.items() if not rows]
    if empty:
        raise ValueError(f"runs {empty} logged no step: did they train?")
    names = list(runs)
    # Rows are matched by step: runs that log at other intervals, or a resumed run, line up.
    losses = {n: {r["step"]: r["loss"] for r in rows} for n, rows in runs.items()}
    shared = [step for step in losses[names[0]] if all(step in losses[n] for n in names[1:])]
    lines = ["", "Loss per step" + ("" if len(names) == 1 else " (the steps every run logged)"),
             "step  " + "  ".join(f"{n:>14}" for n in names)]
    for step in shared:
        lines.append(f"{step:>4}  " + "  ".join(f"{losses[n][step]:>14.6f}" for n in names))
    lines += [f"{n:>14}: {sparkline([s['loss'] for s in runs[n]])}" for n in names]
    if len(names) > 1 and shared:
        diff = max(abs(losses[n][step] - losses[names[0]][step]) for n in names[1:] for step in shared)
        lines.append(f"largest loss difference from {names[0]}: {diff:.3g}")
    elif len(names) > 1:
        lines.append("no step was logged by every run: the losses are not compared")

    lines += ["", "Summary (tok/s: median over steps after the first, profiled ones left out; memory in GiB, "
                  "peaks over the run)"]
    present = [k for k in SUMMARY_KEYS if any(k in s for r in runs.values() for s in r)]
    lines.append(
        f"{'run':>14}  {'tok/s':>9}  {'first loss':>10}  {'last loss':>9}  " + "  ".join(f"{k:>22}" for k in present)
    )
    for n, steps in runs.items():
        tps = median_tokens_per_second(steps)
        cells = [f"{cell(peak(steps, k), '.4f'):>22}" for k in present]
        lines.append(
            f"{n:>14}  {tps:>9.0f}  {steps[0]['loss']:>10.4f}  {steps[-1]['loss']:>9.4f}  " + "  ".join(cells)
        )
    return "\n".join(lines)
