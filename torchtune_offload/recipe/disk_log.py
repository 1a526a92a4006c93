"""Reading the metrics a run wrote with torchtune's ``DiskLogger``.

The logger writes one line per logged step, ``Step <N> | key:value key:value ...``, to
``<output_dir>/logs/<filename>`` (``log_<unix time>.txt`` unless the config names the file). A run
resumed from a step checkpoint starts a new file there, from the step after the checkpoint's.
"""

import re
from pathlib import Path
from typing import Dict, List, Union

#: The metric logger whose files are read here (the configs' default).
DISK_LOGGER = "torchtune.training.metric_logging.DiskLogger"
_STEP_LINE = re.compile(r"^Step (\d+) \| (.*)$")


def read_disk_log(path: Union[str, Path]) -> List[Dict[str, float]]:
    """The metrics of every logged step, in order, each a dict with its ``step``.

    Args:
        path: a DiskLogger file, or a run's ``output_dir`` (or its ``logs`` folder). Of a folder, the newest
            ``logs/log_*.txt`` is read, after the steps of the earlier files it resumed: a file
            whose first step is later than an earlier file's first step continues that run (the
            earlier file's steps from the resumed one on, which the resumed run logged again, are
            left out); a file that starts where the earlier one did is a new run.

    Raises:
        FileNotFoundError: if ``path`` does not exist, or is a directory without a DiskLogger file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no DiskLogger file at {path}: is it the run's output_dir or its log file?")
    if path.is_dir():
        files = _log_files(path)
        if not files:
            # A sweep's output directory holds one run per variant: name them, as a user meant one.
            runs = runs_inside(path)
            if runs:
                inside = f"; it holds runs in {', '.join(map(str, runs))}"
            elif (path / "logs" / "wandb").is_dir():  # torchtune's WandBLogger writes its files there
                inside = (": the run logged to W&B only (logs/wandb). Compare it in W&B, or run it again with "
                          f"metric_logger._component_={DISK_LOGGER}")
            else:
                inside = f": did the run start, with metric_logger._component_={DISK_LOGGER}?"
            raise FileNotFoundError(f"no DiskLogger file (logs/log_*.txt) under {path}{inside}")
        return _resumed_run(files)
    return _rows(path)


def has_disk_log(path: Union[str, Path]) -> bool:
    """``path`` is a run's ``output_dir`` (or its ``logs`` folder) with a DiskLogger file."""
    return bool(_log_files(Path(path)))


def runs_inside(path: Union[str, Path]) -> List[Path]:
    """The folders in ``path`` that are runs with a DiskLogger file (a sweep's variants), by name."""
    return sorted(d for d in Path(path).iterdir() if d.is_dir() and has_disk_log(d))


def _log_files(path: Path) -> List[Path]:
    """The DiskLogger files of the run in folder ``path`` (its output_dir, or its logs folder itself),
    oldest first."""
    files = list((path / "logs").glob("log_*.txt")) or list(path.glob("log_*.txt"))
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def _resumed_run(files: List[Path]) -> List[Dict[str, float]]:
    """The rows of the newest of ``files`` (oldest first), preceded by those of the runs it resumed."""
    rows = _rows(files[-1])
    for earlier in reversed(files[:-1]):
        before = _rows(earlier)
        if not before:
            continue  # a run stopped before its first logged step
        if not rows or rows[0]["step"] <= before[0]["step"]:
            break  # the later file is a run of its own (or logged nothing yet)
        rows = [r for r in before if r["step"] < rows[0]["step"]] + rows
    return rows


def _rows(path: Path) -> List[Dict[str, float]]:
    rows = []
    for line in path.read_text().splitlines():
        m = _STEP_LINE.match(line.strip())
        if m:
            metrics = (item.split(":", 1) for item in m.group(2).split())
            rows.append({"step": int(m.group(1)), **{k: float(v) for k, v in metrics}})
    return rows
