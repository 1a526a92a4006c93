"""Reading the metrics a run wrote with torchtune's ``DiskLogger``.

The logger writes one line per logged step, ``Step <N> | key:value key:value ...``, to
``<output_dir>/logs/<filename>`` (``log_<unix time>.txt`` unless the config names the file).
"""

import re
from pathlib import Path
from typing import Dict, List, Union

_STEP_LINE = re.compile(r"^Step (\d+) \| (.*)$")


def read_disk_log(path: Union[str, Path]) -> List[Dict[str, float]]:
    """The metrics of every logged step, in order, each a dict with its ``step``.

    Args:
        path: a DiskLogger file, or a run's ``output_dir``, whose newest ``logs/log_*.txt`` is read.

    Raises:
        FileNotFoundError: if ``path`` does not exist, or is a directory without a DiskLogger file.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no DiskLogger file at {path}: is it the run's output_dir or its log file?")
    if path.is_dir():
        files = sorted((path / "logs").glob("log_*.txt"), key=lambda p: (p.stat().st_mtime, p.name))
        if not files:
            # A sweep's output directory holds one run per variant: name them, as a user meant one.
            runs = sorted(d.name for d in path.iterdir() if any((d / "logs").glob("log_*.txt")))
            inside = f"; it holds runs in {', '.join(f'{path / r}' for r in runs)}" if runs else ": did the run start?"
            raise FileNotFoundError(f"no DiskLogger file (logs/log_*.txt) under {path}{inside}")
        path = files[-1]
    rows = []
    for line in path.read_text().splitlines():
        m = _STEP_LINE.match(line.strip())
        if m:
            metrics = (item.split(":", 1) for item in m.group(2).split())
            rows.append({"step": int(m.group(1)), **{k: float(v) for k, v in metrics}})
    return rows
