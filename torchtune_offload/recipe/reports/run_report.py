"""Side-by-side loss curves and a tok/s + memory summary of runs read from their DiskLogger files."""

import math
import statistics
from typing import Any, Dict, List, Mapping, Optional

from torchtune.training.metric_logging import WandBLogger

from torchtune_offload.recipe.reports.disk_log import read_disk_log

#: Memory figures summarised when any run logged them (GiB, peak over the run).
SUMMARY_KEYS = (
    "peak_memory_alloc", "peak_memory_reserved", "nvml_device_used_peak", "host_rss_peak",
    "optimizer_host", "optimizer_pinned", "optimizer_device_saved",
)
#: What NVML's figure is, said where a comparison shows it (a sweep's table subtracts the baseline).
NVML_NOTE = ("nvml_device_used_peak is the whole GPU's memory in use, other processes' included "
             "(scripts/benchmark_sweep.py subtracts what was in use before each run)")


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


def run_figures(rows: List[Dict[str, float]]) -> Dict[str, float]:
    """A finished run's figures, as a sweep's W&B summary names them: ``tokens_per_second_median``
    and, per memory figure the run logged, ``<key>_gib``, its peak over the run.

    Args:
        rows: the metrics the run logged, one dict a logged step (as :func:`read_disk_log` gives them).
    """
    figures = {"tokens_per_second_median": median_tokens_per_second(rows)} if rows else {}
    return {**figures, **{f"{key}_gib": value for key in SUMMARY_KEYS if (value := peak(rows, key)) is not None}}


def run_summary(rows: List[Dict[str, float]], *, disk_log: bool = True) -> str:
    """One line on a finished run from its logged rows: its median tok/s and its memory peaks.

    Args:
        rows: the metrics the run logged, one dict a logged step (as :func:`read_disk_log` gives them).
        disk_log: the run logged with DiskLogger, whose files ``tune-offload compare`` reads: the
            line ends by saying so.
    """
    if not rows:
        return "Finished: no step was logged (log_every_n_steps is larger than the run)."
    peaks = [f"{key} {value:.2f}" for key in SUMMARY_KEYS if (value := peak(rows, key)) is not None]
    return (f"Finished: {median_tokens_per_second(rows):.1f} tok/s (median of the logged steps after the first)"
            + (f"; peak memory, GiB: {', '.join(peaks)}" if peaks else "")
            + (". `tune-offload compare NAME=<output_dir> ...` puts runs side by side." if disk_log else "."))


def summarise_in_wandb(metric_logger: Any, rows: List[Dict[str, float]]) -> None:
    """Puts :func:`run_figures` in the W&B run's summary: W&B's own summary holds each key's last
    logged value, which for tok/s is one step's and for the memory peaks the last log line's (they
    are reset at each).

    Args:
        metric_logger: the run's metric logger; nothing is done unless it is torchtune's
            WandBLogger with a run (rank 0's).
        rows: the metrics the run logged, one dict a logged step.
    """
    if not isinstance(metric_logger, WandBLogger):
        return
    import wandb  # optional dependency; WandBLogger has imported it already

    if wandb.run is not None and rows:
        wandb.run.summary.update(run_figures(rows))


def first_nonfinite(rows: List[Dict[str, float]]) -> Optional[str]:
    """Where a run diverged.

    Args:
        rows: the metrics the run logged, one dict a logged step.

    Returns:
        The first logged step whose loss or gradient norm is nan or inf, as ``"loss nan at step 8"``;
        None where every one is finite.
    """
    for row in rows:
        for key in ("loss", "grad_norm"):
            if key in row and not math.isfinite(row[key]):
                return f"{key} {row[key]} at step {row['step']}"
    return None


def compare_runs(output_dirs: Mapping[str, str]) -> str:
    """The comparison of runs, by name, as printable text.

    Args:
        output_dirs: run name -> the run's ``output_dir`` (its DiskLogger files are read, see
            :func:`read_disk_log`).
    """
    runs: Dict[str, List[Dict[str, float]]] = {n: read_disk_log(d) for n, d in output_dirs.items()}
    empty = [n for n, rows in runs.items() if not rows]
    if empty:
        raise ValueError(f"runs {empty} logged no step: did they train?")
    names = list(runs)
    w = max(14, *map(len, names))  # the names head columns: a long one widens them all
    # Rows are matched by step: runs that log at other intervals, or a resumed run, line up.
    losses = {n: {r["step"]: r["loss"] for r in rows} for n, rows in runs.items()}
    shared = [step for step in losses[names[0]] if all(step in losses[n] for n in names[1:])]
    lines = ["", "Loss per step" + ("" if len(names) == 1 else " (the steps every run logged)"),
             "step  " + "  ".join(f"{n:>{w}}" for n in names)]
    for step in shared:
        lines.append(f"{step:>4}  " + "  ".join(f"{losses[n][step]:>{w}.6f}" for n in names))
    lines += [f"{n:>{w}}: {sparkline([s['loss'] for s in runs[n]])}" for n in names]
    if len(names) > 1 and shared:
        diff = max(abs(losses[n][step] - losses[names[0]][step]) for n in names[1:] for step in shared)
        lines.append(f"largest loss difference from {names[0]}: {diff:.3g}")
    elif len(names) > 1:
        lines.append("no step was logged by every run: the losses are not compared")

    lines += ["", "Summary (tok/s: median over steps after the first, profiled ones left out; memory in GiB, "
                  "peaks over the run)"]
    present = [k for k in SUMMARY_KEYS if any(k in s for r in runs.values() for s in r)]
    lines.append(
        f"{'run':>{w}}  {'tok/s':>9}  {'first loss':>10}  {'last loss':>9}  " + "  ".join(f"{k:>22}" for k in present)
    )
    for n, steps in runs.items():
        tps = median_tokens_per_second(steps)
        cells = [f"{cell(peak(steps, k), '.4f'):>22}" for k in present]
        lines.append(
            f"{n:>{w}}  {tps:>9.0f}  {steps[0]['loss']:>10.4f}  {steps[-1]['loss']:>9.4f}  " + "  ".join(cells)
        )
    lines += [f"{n} diverged: {where}" for n, steps in runs.items() if (where := first_nonfinite(steps))]
    if "nvml_device_used_peak" in present:
        lines.append(NVML_NOTE)
    return "\n".join(lines)
