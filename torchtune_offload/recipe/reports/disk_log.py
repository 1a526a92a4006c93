"""Reading the metrics a run wrote with torchtune's ``DiskLogger``.

The logger writes one line per logged step, ``Step <N> | key:value key:value ...``, to
``<output_dir>/logs/<filename>`` (``log_<unix time>.txt`` unless the config names the file; a named
file, or a second run within the same second, is appended to). A run resumed from a step checkpoint
logs again from the step after the checkpoint's: in a new file, or after the earlier run's lines in
a named one.
"""

import re
from pathlib import Path
from typing import Dict, List, Union

#: The metric logger whose files are read here (the configs' default).
DISK_LOGGER = "torchtune.training.metric_logging.DiskLogger"
_STEP_LINE = re.compile(r"^Step (\d+) \| (.*)$")


def read_disk_log(path: Union[str, Path]) -> List[Dict[str, float]]:
    """The metrics of every logged step of one run, in step order, each a dict with its ``step``.

    A run resumed from a step checkpoint is read whole. Its lines (in a later file of the folder, or
    later in the same file) start at a later step than the run it resumed started at; they replace
    that run's lines from that step on, which the resumed run logged again. Lines that start at or
    before the earlier run's first step are a new run, read alone. This assumes the runs of a folder
    log at the same interval (``log_every_n_steps``): a new run logging every 5 steps after one
    logging every step would be read as its resumption.

    Args:
        path: a DiskLogger file, or a run's ``output_dir`` (or its ``logs`` folder), whose
            ``logs/log_*.txt`` files are read oldest first, the newest run's steps returned.

    Returns:
        The rows, empty where the run logged no step yet.

    Raises:
        FileNotFoundError: if ``path`` does not exist, or is a directory without a DiskLogger file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no DiskLogger file at {path}: is it the run's output_dir or its log file?")
    files = [path]
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
    rows: List[Dict[str, float]] = []
    for segment in (segment for f in files for segment in _segments(f)):
        if rows and segment[0]["step"] > rows[0]["step"]:  # a resumption of the run so far
            rows = [r for r in rows if r["step"] < segment[0]["step"]] + segment
        else:  # the first run, or a new one
            rows = segment
    return rows


def has_disk_log(path: Union[str, Path]) -> bool:
    """Whether a folder holds a run's DiskLogger file (which may hold no step yet).

    Args:
        path: a folder: a run's ``output_dir``, or its ``logs`` folder.

    Returns:
        True where ``path`` has a ``logs/log_*.txt`` or a ``log_*.txt`` file.
    """
    return bool(_log_files(Path(path)))


def runs_inside(path: Union[str, Path]) -> List[Path]:
    """The runs in a folder of runs, as a sweep's output folder holds one per variant.

    Args:
        path: a folder.

    Returns:
        Its sub-folders for which :func:`has_disk_log` holds, sorted by name.
    """
    return sorted(d for d in Path(path).iterdir() if d.is_dir() and has_disk_log(d))


def _log_files(path: Path) -> List[Path]:
    """The DiskLogger files of the run in folder ``path`` (its output_dir, or its logs folder itself),
    oldest first."""
    files = list((path / "logs").glob("log_*.txt")) or list(path.glob("log_*.txt"))
    return sorted(files, key=lambda p: (p.stat().st_mtime, p.name))


def _segments(path: Path) -> List[List[Dict[str, float]]]:
    """The rows of DiskLogger file ``path``, split where the step goes back (a run appended after
    another: resumed, or new). Each segment is non-empty."""
    segments: List[List[Dict[str, float]]] = []
    for line in path.read_text().splitlines():
        m = _STEP_LINE.match(line.strip())
        if m:
            metrics = (item.split(":", 1) for item in m.group(2).split())
            row = {"step": int(m.group(1)), **{k: float(v) for k, v in metrics}}
            if not segments or row["step"] <= segments[-1][-1]["step"]:
                segments.append([])
            segments[-1].append(row)
    return segments
