"""Run one config with each optimizer variant, one ``tune run`` after another, and tabulate the results.

Every variant runs ``recipes/full_finetune_single_device.py`` with the same config and overrides; only
what the variant sets (``bench/variants.py``: the optimizer block, and for ``paged_adamw8bit_in_bwd``
``optimizer_in_bwd`` without clipping or accumulation) differs. A variant the
config check refuses, that runs out of memory or that fails is reported as such and the sweep goes on.
A variant whose training diverged (the recipe stopped at a nan or inf loss or gradient norm) is
``diverged``, with the figures of the steps it logged.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from torchtune_offload.bench.variants import VARIANTS
from torchtune_offload.recipe.divergence import TrainingDivergedError
from torchtune_offload.recipe.reports.disk_log import read_disk_log
from torchtune_offload.recipe.reports.memory import EXPANDABLE_SEGMENTS
from torchtune_offload.recipe.reports.run_report import cell, first_nonfinite, median_tokens_per_second, peak

_OOM_MARKERS = ("OutOfMemoryError", "CUDA out of memory", "out of memory")
GIB = 1024**3
#: A variant's status when its training diverged.
DIVERGED = "diverged"


@dataclass
class VariantResult:
    """One variant's outcome: ``status`` is ``ok``, ``diverged`` or why it did not train; the
    figures are ``None`` when it did not train (a diverged variant has those of its logged steps)."""

    name: str
    status: str
    seconds: float
    output_dir: str
    tokens_per_second: Optional[float] = None
    first_loss: Optional[float] = None
    last_loss: Optional[float] = None
    steps: int = 0
    peaks_gib: Dict[str, float] = field(default_factory=dict)
    #: The steps the sweep asked for; ``steps`` (those logged) is fewer where one epoch of the data
    #: ended first, or the run stopped.
    steps_requested: int = 0


def _nvml_gpu() -> Optional[object]:
    """(pynvml, handle of the GPU the variants train on: CUDA's device 0), or None without NVML.
    NVML creates no CUDA context in this process. NVML numbers every GPU of the machine, so under
    ``CUDA_VISIBLE_DEVICES`` its first entry is looked up: a UUID as such, an index as NVML's
    (the same GPU where ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the variants get unless it is set)."""
    try:
        import pynvml  # optional dependency (the `gpu` extra)

        pynvml.nvmlInit()
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        if first.startswith(("GPU-", "MIG-")):
            # CUDA takes any unique prefix of a UUID; NVML's lookup wants it whole.
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            return pynvml, next(h for h in handles if str(pynvml.nvmlDeviceGetUUID(h)).startswith(first))
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(int(first or 0))
    except Exception:
        return None


def _nvml_used_bytes() -> Optional[int]:
    """Device-wide used memory of the variants' GPU as NVML reports it, or None without NVML."""
    nvml = _nvml_gpu()
    return None if nvml is None else nvml[0].nvmlDeviceGetMemoryInfo(nvml[1]).used


def device_name() -> str:
    """The variants' GPU's name from NVML (no CUDA context, which would hold device memory for the whole
    sweep), or CPU."""
    nvml = _nvml_gpu()
    return "CPU" if nvml is None else str(nvml[0].nvmlDeviceGetName(nvml[1]))


def _failure(log_text: str, returncode: int) -> str:
    # The recipe's own error for a run that diverged, before any message its traceback may hold.
    if f"{TrainingDivergedError.__name__}:" in log_text:
        return DIVERGED
    if any(m in log_text for m in _OOM_MARKERS):
        return "out of memory"
    if returncode in (-9, 137):
        return "killed (host out of memory?)"
    lines = log_text.splitlines()
    starts = [i for i, line in enumerate(lines) if "Error:" in line]
    if not starts:
        return f"failed with exit code {returncode}"
    # The last error and its indented continuation lines (the config check lists one problem per line).
    i = starts[-1]
    message = [lines[i].strip()] + [l.strip() for l in lines[i + 1:] if l.startswith("  ")][:5]
    return "failed: " + " ".join(message)[:400]


def diverged(rows: List[Dict[str, float]]) -> bool:
    """A logged loss or gradient norm is nan or inf (a run that went on after it still diverged)."""
    return first_nonfinite(rows) is not None


def variant_environment() -> Dict[str, str]:
    """Every variant's environment: the allocator setting the recipes give offload runs on CUDA
    (expandable segments) for the plain and bitsandbytes variants too, so that reserved and NVML
    peaks differ by optimizer, not by allocator; a ``PYTORCH_CUDA_ALLOC_CONF`` of the user's is kept.

    Returns:
        A copy of this process's environment with the setting added.
    """
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", EXPANDABLE_SEGMENTS)
    # An index in CUDA_VISIBLE_DEVICES then means the same GPU to the variants and to NVML's baseline.
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    env.setdefault("MASTER_ADDR", "127.0.0.1")  # the distributed variants' ranks meet on this machine
    return env


def variant_overrides(*, name: str, config: str, steps: int, output_dir: Path, extra: Sequence[str]) -> List[str]:
    """The ``key=value`` overrides variant ``name`` runs ``config`` with: its optimizer's, the sweep's
    own, ``extra`` (the user's, given to every variant), then what the variant needs, as the
    planner plans it (``Variant.overrides``)."""
    variant = VARIANTS[name]
    return [*variant.choice_overrides(config), f"max_steps_per_epoch={steps}", "epochs=1",
            f"output_dir={output_dir / name}", "log_peak_memory_stats=True", "log_every_n_steps=1",
            # Benchmarks keep no checkpoint worth protecting: variants may share a checkpoint folder.
            "overwrite_checkpoints=True", *extra, *variant.needs]


def run_variant(
    *, name: str, config: str, steps: int, output_dir: Path, extra: Sequence[str], timeout_s: Optional[float],
    nproc_per_node: int = 2,
) -> VariantResult:
    """Runs one variant to completion (or failure) and reads back its DiskLogger metrics.

    An earlier run's metric logs in the variant's folder are removed first (the sweep script
    replaces an earlier sweep's results only with ``--force``): a run that fails before it logs
    would otherwise be read, and compared, as the earlier one.
    """
    out = output_dir / name
    shutil.rmtree(out / "logs", ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    variant = VARIANTS[name]
    launch = ["--nproc_per_node", str(nproc_per_node)] if variant.distributed else []
    cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", *launch, f"recipes/{variant.recipe}.py",
           "--config", config,
           *variant_overrides(name=name, config=config, steps=steps, output_dir=output_dir, extra=extra)]
    log_path = out / "run.log"
    baseline = _nvml_used_bytes()
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                        env=variant_environment()).returncode
        except subprocess.TimeoutExpired:
            returncode = None
    seconds = time.perf_counter() - start
    text = log_path.read_text()
    if returncode is None:
        return VariantResult(name, f"timed out after {timeout_s:.0f} s", seconds, str(out), steps_requested=steps)
    status = "ok" if returncode == 0 else _failure(text, returncode)
    if status not in ("ok", DIVERGED):
        return VariantResult(name, status, seconds, str(out), steps_requested=steps)
    try:
        rows = read_disk_log(out)
    except FileNotFoundError as err:  # the config logs elsewhere (one of --'s overrides, say)
        return VariantResult(name, f"failed: {err}", seconds, str(out), steps_requested=steps)
    if diverged(rows):
        status = DIVERGED
    result = VariantResult(name, status, seconds, str(out), steps=len(rows), steps_requested=steps)
    if not rows:
        if status == "ok":
            result.status = "failed: no step logged"
        return result
    result.tokens_per_second = median_tokens_per_second(rows)
    result.first_loss, result.last_loss = rows[0]["loss"], rows[-1]["loss"]
    for key in ("peak_memory_alloc", "peak_memory_reserved", "host_rss_peak", "nvml_device_used_peak"):
        value = peak(rows, key)
        if value is not None:
            result.peaks_gib[key] = value
    if "nvml_device_used_peak" in result.peaks_gib and baseline is not None:
        # NVML sees the whole device: what other processes (a ballast) held before the run is not the run's.
        result.peaks_gib["nvml_run_peak"] = result.peaks_gib["nvml_device_used_peak"] - baseline / GIB
    return result


def markdown_table(results: Sequence[VariantResult]) -> str:
    """The results as a markdown table (memory in GiB, peaks over the run)."""
    lines = [
        "| variant | status | tok/s (median) | allocator peak | reserved peak | NVML peak (run) | host RSS peak "
        "| loss first -> last | steps | wall s |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        p = r.peaks_gib
        loss = "-" if r.first_loss is None else f"{r.first_loss:.4f} -> {r.last_loss:.4f}"
        # Fewer than asked: an epoch of the data ended first, or the run stopped (its status says which).
        steps = f"{r.steps} of {r.steps_requested}" if r.steps < r.steps_requested else str(r.steps)
        lines.append(
            f"| {r.name} | {r.status.replace('|', '/')} | {cell(r.tokens_per_second, '.0f')} "
            f"| {cell(p.get('peak_memory_alloc'), '.2f')} | {cell(p.get('peak_memory_reserved'), '.2f')} "
            f"| {cell(p.get('nvml_run_peak'), '.2f')} | {cell(p.get('host_rss_peak'), '.2f')} "
            f"| {loss} | {steps} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def write_results(results: Sequence[VariantResult], *, output_dir: Path, header: str) -> Path:
    """Writes ``results.md`` (header and table) and ``results.json`` under ``output_dir``; returns the former."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    md = output_dir / "results.md"
    md.write_text(f"{header}\n\n{markdown_table(results)}\n")
    return md


def write_plot(results: Sequence[VariantResult], *, path: Path, title: str) -> Path:
    """A PNG: tok/s against peak device memory per variant, and the loss curves.

    The memory axis is NVML's peak for the run where there is one (it sees bitsandbytes' unified
    memory), else the allocator's reserved peak, else (on a CPU device) the host RSS peak.
    """
    import matplotlib  # optional dependency (the `bench` extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if r.tokens_per_second is not None]
    fig, (ax_speed, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for key, label in (("nvml_run_peak", "NVML peak, GiB"), ("peak_memory_reserved", "allocator reserved peak, GiB"),
                       ("host_rss_peak", "host RSS peak, GiB (CPU device)")):
        if ran and all(key in r.peaks_gib for r in ran):
            break
    for r in ran:
        ax_speed.scatter(r.peaks_gib.get(key, 0.0), r.tokens_per_second)
        ax_speed.annotate(r.name, (r.peaks_gib.get(key, 0.0), r.tokens_per_second), fontsize=8,
                          xytext=(4, 4), textcoords="offset points")
        rows = read_disk_log(r.output_dir)
        ax_loss.plot([row["step"] for row in rows], [row["loss"] for row in rows], label=r.name)
    ax_speed.set(xlabel=label, ylabel="tok/s (median)", title=f"speed against {label.split(',')[0]}")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    if ran:
        ax_loss.legend(fontsize=8)
    failed = [f"{r.name}: {r.status}" for r in results if r.tokens_per_second is None]
    text = title + (" Not run: " + "; ".join(failed) if failed else "")
    gone = [r.name for r in ran if r.status == DIVERGED]
    text += f" Diverged: {', '.join(gone)}." if gone else ""
    fig.suptitle("\n".join(textwrap.wrap(text, 150)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def log_to_wandb(
    results: Sequence[VariantResult],
    *,
    project: str,
    group: str,
    config: Dict[str, object],
    recipe_configs: Optional[Dict[str, Dict[str, object]]] = None,
    directory: Optional[Path] = None,
) -> List[Dict[str, str]]:
    """One W&B run per variant in ``group``: its logged steps replayed, peaks and tok/s in the summary.

    The runs log what the recipe wrote to its DiskLogger file, after the fact, so the sweep's
    timings are not disturbed by W&B. ``WANDB_MODE=offline`` keeps them on disk. Each step is logged
    with its ``global_step``, W&B's x-axis for it, as torchtune's WandBLogger logs a recipe run, so
    the sweep's runs and recipe runs logged to W&B overlay step for step. Each run's config also
    says what its variant is (``description``), the optimizer keys it sets (``variant_optimizer.*``,
    which W&B can filter and group by), its other overrides and, where given, the config its recipe
    ran (``recipe_config``, from ``recipe_configs`` by variant name). ``directory`` is where W&B
    writes its files (its ``wandb`` folder), unless ``WANDB_DIR`` says elsewhere; the working
    directory without either.

    Returns:
        Per run: its ``id``, ``name`` and ``group``.
    """
    # W&B is imported only when a sweep logs to it: a sweep that writes its table and plot runs
    # where wandb is not installed (the GPU machine, for one).
    import wandb

    ids = []
    for r in results:
        variant = VARIANTS[r.name]
        where = {} if directory is None or os.environ.get("WANDB_DIR") else {"dir": str(directory)}
        run = wandb.init(project=project, group=group, name=r.name, job_type="sweep", reinit="create_new", **where,
                         config={**config, "variant": r.name, "status": r.status, "description": variant.description,
                                 "variant_optimizer": dict(variant.optimizer),
                                 "variant_overrides": " ".join([*variant.settings, *variant.needs]),
                                 **({"recipe_config": recipe_configs[r.name]} if recipe_configs else {})})
        run.define_metric("global_step")
        run.define_metric("*", step_metric="global_step", step_sync=True)
        for row in read_disk_log(r.output_dir) if r.steps else []:
            run.log({**{k: v for k, v in row.items() if k != "step"}, "global_step": int(row["step"])})
        run.summary.update({"status": r.status, "tokens_per_second_median": r.tokens_per_second, "wall_s": r.seconds,
                            **{f"{k}_gib": v for k, v in r.peaks_gib.items()}})
        ids.append({"id": run.id, "name": run.name, "group": run.group})
        run.finish()
    return ids
