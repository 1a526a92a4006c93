"""The recorded GPU measurements (``gpu_runs.json``) and the markdown tables of docs/gpu_results.md.

``python -m torchtune_offload.plan.recorded_runs --tables`` prints the tables; with ``--write PAGE`` it
replaces what ``PAGE`` holds between :data:`BEGIN` and :data:`END`. ``tests/plan/test_gpu_runs.py``
checks that docs/gpu_results.md holds them as generated.
"""

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

GPU_RUNS = Path(__file__).with_name("gpu_runs.json")
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
#: The runs' models: their key in gpu_runs.json and the name the tables give them.
MODELS = {"llama3_2_1b": "llama3_2 1B", "llama3_2_3b": "llama3_2 3B", "llama3_1_8b": "llama3_1 8B"}
#: The per-part timings the recipe and scripts/bench/bench_overlap.py log, in the order the table shows them.
PARTS = ("offload_wait_s", "host_step_s", "grad_copy_s", "param_copy_s", "grad_sum_wait_s", "grad_sum_add_s",
         "host_step_hidden")
ALLOCATOR_COUNTS = ("alloc_retries", "device_allocs", "sync_all_streams")
PROBE_KEYS = ("gpu_bf16_tflops", "pcie_h2d_gbs", "pcie_d2h_gbs", "host_copy_gbs", "host_adamw_bf16_mparams",
              "host_adamw8bit_mparams", "host_adamw_master_mparams", "host_cores", "device_sync_us")


@lru_cache(maxsize=None)
def _load(path: Path) -> str:
    return path.read_text()


def load(path: Path = GPU_RUNS) -> Dict[str, Any]:
    """The data file, parsed afresh (callers may change what they get)."""
    return json.loads(_load(path))


def run_rows(data: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every recorded run, its group's settings under its own (a row's keys override its group's)."""
    return [{"status": "ok", **{k: v for k, v in group.items() if k != "rows"}, **row}
            for group in data["runs"] for row in group["rows"]]


def run_name(run: Dict[str, Any]) -> str:
    """The variant, then what the run set beyond it: ``offload_grads_overlap, accumulation 4, clip 1.0``."""
    parts = [run["variant"]]
    if run["accumulation"] > 1:
        parts.append(f"accumulation {run['accumulation']}")
    if run["clip"] is not None:
        parts.append(f"clip {run['clip']}")
    return ", ".join(parts + list(run.get("options", ())))


def gpu_memory(run: Dict[str, Any]) -> str:
    return "whole GPU" if run["gpu_memory_gib"] is None else f"GPU limited to {run['gpu_memory_gib']} GiB"


def tokens_per_second(run: Dict[str, Any]) -> Optional[float]:
    """The run's median tok/s; from its median step time where it gives only that; None if it did not run."""
    if run["status"] != "ok":
        return None
    if "tokens_per_second" in run:
        return run["tokens_per_second"]
    return run["batch"] * run["seq"] * run["accumulation"] / run["step_seconds"]


def _n(value: Any, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """A markdown table; a column of numbers (or ``-``) is right-aligned."""
    number = re.compile(r"-|-?[0-9.]+(( \+ |, )-?[0-9.]+)*")
    numeric = [all(number.fullmatch(row[i]) for row in rows) for i in range(len(header))]
    align = ["---:" if n else "---" for n in numeric]
    cells = [[cell.replace("|", "\\|") for cell in row] for row in rows]
    return [f"| {' | '.join(header)} |", f"|{'|'.join(align)}|"] + [f"| {' | '.join(r)} |" for r in cells]


def _key(entry: Dict[str, Any]) -> List[str]:
    return [entry["date"], f"`{entry['commit']}`", entry["device"]]


def _what(entry: Dict[str, Any]) -> str:
    """The command that made an entry, and what of it: ``BUDGET_S=565 bash ...`` (its probe step)."""
    if "command" not in entry:
        return entry["what"]
    return f"`{entry['command']}`" + (f" ({entry['what']})" if "what" in entry else "")


def _devices(data: Dict[str, Any]) -> List[str]:
    return ["## Devices", ""] + [
        f"- {name}: {d['memory_mib']} MiB, driver {d['driver']}, torch {d['torch']}, CUDA {d['cuda']}, Python "
        f"{d['python']}; its host a {d['host']} with {d['host_ram_gib']} GiB." for name, d in data["devices"].items()]


def _commands(runs: List[Dict[str, Any]]) -> Dict[str, int]:
    numbers: Dict[str, int] = {}
    for run in runs:
        numbers.setdefault(_what(run), len(numbers) + 1)
    return numbers


def _model(data: Dict[str, Any], model: str) -> List[str]:
    runs = [run for run in run_rows(data) if run["model"] == model]
    commands = _commands(runs)
    rows = []
    for run in runs:
        tps = tokens_per_second(run)
        nvml = (_n(run["nvml_peak_gib"], ".2f") if "nvml_peak_gib" in run else
                f"{run['nvml_used_peak_gib']:.2f} (with the ballast)" if "nvml_used_peak_gib" in run else "-")
        loss = run.get("loss")
        gpu = "whole" if run["gpu_memory_gib"] is None else f"{run['gpu_memory_gib']} GiB"
        rows.append(_key(run) + [
            gpu, f"{run['batch']} x {run['seq']}", run_name(run), run["status"] if tps is None else f"{tps:.0f}",
            _n(run.get("allocator_peak_gib"), ".2f"), _n(run.get("reserved_peak_gib"), ".2f"), nvml,
            _n(run.get("host_rss_peak_gib"), ".2f"), "-" if loss is None else f"{loss[0]:.4f} -> {loss[1]:.4f}",
            str(commands[_what(run)])])
    header = ["date", "commit", "device", "GPU", "batch", "run", "tok/s (median)", "allocator peak",
              "reserved peak", "NVML peak (run)", "host RSS peak", "loss first -> last", "command"]
    lines = [f"## {MODELS[model]}", ""] + _table(header, rows) + [""]
    for what, number in commands.items():
        run = next(r for r in runs if _what(r) == what)
        measured = run.get("measured_steps", f"2-{run['steps']}")
        ballast = f", the ballast holding {run['ballast_gib']} GiB" if run.get("ballast_gib") else ""
        title = f", {run['title']}" if run.get("title") else ""
        lines.append(f"{number}. {run['date']}, `{run['commit']}`{title}: {run['steps']} steps, medians of steps "
                     f"{measured}{ballast}: {what}")
    return lines


def _timings(data: Dict[str, Any]) -> List[str]:
    runs = [run for run in run_rows(data) if "parts" in run]
    rows = []
    for run in runs:
        parts = run["parts"]
        counts = ", ".join(_n(parts[k]) for k in ALLOCATOR_COUNTS) if ALLOCATOR_COUNTS[0] in parts else "-"
        rows.append(_key(run) + [MODELS[run["model"]], f"{run['batch']} x {run['seq']}", run_name(run),
                                 _n(run["step_seconds"])] + [_n(parts.get(k)) for k in PARTS] + [counts])
    header = ["date", "commit", "device", "model", "batch", "run", "s/step"] + list(PARTS) + [
        "allocator retries, driver allocations, all-stream syncs"]
    return ["## Per-part timings", "", "Medians of the measured steps, seconds a step (commands: under each model).",
            ""] + _table(header, rows)


def _profiles(data: Dict[str, Any]) -> List[str]:
    lines = ["## A profiled step"]
    for profile in data["profiles"]:
        rows = [[p["phase"], f"{p['from_s']:.2f} - {p['to_s']:.2f}", " + ".join(_n(x, ".2f") for x in p["length_s"]),
                 " + ".join(_n(x) for x in p["kernels_s"]), p["beside"]] for p in profile["phases"]]
        lines += ["", f"{profile['date']}, `{profile['commit']}`, {profile['device']}: {profile['run']}, step "
                  f"{profile['step']} ({profile['step_seconds']} s); {_what(profile)}.", ""]
        lines += _table(["phase", "from - to, s", "length, s", "compute-stream kernels, s", "beside it"], rows)
    return lines


def _tests(data: Dict[str, Any]) -> List[str]:
    rows = []
    for test in data["tests"]:
        seconds = _n(test.get("seconds"))
        if "cap_s" in test:
            seconds = f"cap {test['cap_s']}" if seconds == "-" else f"{seconds} (cap {test['cap_s']})"
        rows.append(_key(test) + ["yes" if test.get("sanitizer") else "no", _what(test),
                                  _n(test.get("passed")), _n(test.get("failed")), _n(test.get("errors")),
                                  _n(test.get("not_run")), seconds, test.get("note", "")])
    header = ["date", "commit", "device", "`TORCH_CUDA_SANITIZER=1`", "command", "passed", "failed", "errors",
              "not run", "s", "note"]
    return ["## GPU tests", ""] + _table(header, rows)


def _probes(data: Dict[str, Any]) -> List[str]:
    rows = [_key(p) + [_what(p)] + [_n(p["keys"].get(k)) for k in PROBE_KEYS] for p in data["probes"]]
    return ["## `tune-offload probe`", ""] + _table(["date", "commit", "device", "command"] + list(PROBE_KEYS), rows)


def _pinned(data: Dict[str, Any]) -> List[str]:
    lines = []
    for report in data["pinned"]:
        rows = [_key(report) + [r["optimizer"], _n(r["tensors_gib"], ".3f"), _n(r["pinned_gib"], ".3f"),
                                f"{r['pinned_gib'] / r['tensors_gib']:.4f}", _n(r["host_gib"], ".3f"),
                                _n(r["rss_growth_gib"], ".3f")] for r in report["rows"]]
        header = ["date", "commit", "device", "optimizer", "buffer tensors, GiB", "pinned (report)", "pinned / tensors",
                  "host (report)", "RSS growth"]
        lines += [f"## Pinned host bytes, {MODELS[report['model']]}", "", f"{_what(report)}:", ""]
        lines += _table(header, rows)
    return lines


def _gradient_math(data: Dict[str, Any]) -> List[str]:
    lines = ["## The gradient math of three recipes"]
    for demo in data["gradient_math"]:
        rows = [[str(step)] + [_n(v) for v in values] for step, values in enumerate(demo["rows"], start=1)]
        lines += ["", f"{demo['date']}, `{demo['commit']}`, {demo['device']}: {_what(demo)}", ""]
        lines += _table(["step"] + demo["columns"], rows)
    return lines


def tables(data: Optional[Dict[str, Any]] = None) -> str:
    """The markdown docs/gpu_results.md holds between its markers."""
    data = load() if data is None else data
    sections = [_devices(data)] + [_model(data, m) for m in MODELS] + [
        _timings(data), _profiles(data), _tests(data), _probes(data), _pinned(data), _gradient_math(data)]
    return "\n\n".join("\n".join(lines) for lines in sections)


def with_tables(page: str, block: str) -> str:
    """``page`` with ``block`` between its markers, in place of what was there."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return f"{page[:start]}\n{block}\n{page[end:]}"


def marked_block(page: str) -> str:
    """What ``page`` holds between its markers, without the blank lines at either end."""
    return page[page.index(BEGIN) + len(BEGIN):page.index(END)].strip("\n")
