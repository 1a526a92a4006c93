"""Checkpoint saves that a crash cannot half-write.

torchtune's checkpointers write into ``output_dir`` in place: a crash (or a full disk) during a save
leaves a half-written ``epoch_<N>`` folder and, worse, a half-written ``recipe_state.pt``, the only
state a run resumes from. :func:`save_atomically` lets the checkpointer write everything into a
staging folder inside ``output_dir``, flushes it to disk, and only then moves each piece into place
with renames: the weights folder first, then the recipe state (an atomic file replace), so at every
moment the previous complete checkpoint stays loadable. A marker file ``.complete`` is written last
into the epoch folder.
"""

import logging
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any, Dict, List

from torchtune.utils import get_logger

#: Written into each epoch folder once everything of that save is in place.
COMPLETE_MARKER = ".complete"
_STAGING_PREFIX = ".saving_epoch_"


def fsync_tree(root: Path, *, files: bool = True) -> None:
    """Flushes ``root`` to disk: every file under it (unless ``files=False``), then every folder."""
    if files:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
    for path in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HeldLines(logging.Filter):
    """Holds back the lines below WARNING that the saving thread logs (torchtune's checkpointer)
    while it writes into the staging folder: they name paths that exist only until the move, and a
    save that fails part-way did not save what they say. Warnings pass at once (they may say why a
    save fails), and so do other threads' lines on the shared logger."""

    def __init__(self) -> None:
        super().__init__()
        self.records: List[logging.LogRecord] = []
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING or record.thread != self._thread:
            return True
        self.records.append(record)
        return False


def save_atomically(checkpointer: Any, state_dict: Dict[str, Any], *, epoch: int, **save_options: Any) -> None:
    """``checkpointer.save_checkpoint(state_dict, epoch=epoch, **save_options)``, moved into place only when complete.

    Args:
        checkpointer: a torchtune checkpointer (it keeps its destination in ``_output_dir``).
        state_dict: what the recipe saves.
        epoch: the epoch being saved.
        **save_options: passed on (``intermediate_checkpoint``, ``adapter_only``).
    """
    output_dir = Path(checkpointer._output_dir)
    staging = output_dir / f"{_STAGING_PREFIX}{epoch}"
    shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt at this save
    staging.mkdir(parents=True)
    checkpointer._output_dir = staging
    torchtune_log, held = get_logger(), _HeldLines()
    torchtune_log.addFilter(held)
    try:
        checkpointer.save_checkpoint(state_dict, epoch=epoch, **save_options)
    finally:
        checkpointer._output_dir = output_dir
        torchtune_log.removeFilter(held)
    fsync_tree(staging)
    # The weights folder: a previous folder of the same epoch is set aside, not overwritten.
    epoch_dir = staging / f"epoch_{epoch}"
    if epoch_dir.is_dir():
        target = output_dir / epoch_dir.name
        old = output_dir / f"{_STAGING_PREFIX}{epoch}.old"
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        epoch_dir.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    # Everything else (the recipe state) file by file, each replace atomic.
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        target = output_dir / path.relative_to(staging)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
    shutil.rmtree(staging)
    if (output_dir / f"epoch_{epoch}").is_dir():
        marker = output_dir / f"epoch_{epoch}" / COMPLETE_MARKER
        marker.write_text("complete\n")
        with open(marker, "rb") as f:
            os.fsync(f.fileno())
    # torchtune's lines, now that what they say is true, with the paths the files have now.
    for record in held.records:
        record.msg, record.args = _reworded(record.getMessage().replace(str(staging), str(output_dir)), epoch), None
        torchtune_log.handle(record)


def _reworded(line: str, epoch: int) -> str:
    """torchtune 0.6.1's save lines that say what did not happen: every epoch's save (no recipe
    state: the step checkpoints hold it) is its "final epoch checkpoint", and a LoRA save calls its
    adapter's config an "Adapter checkpoint"."""
    if line == "Saving final epoch checkpoint.":
        return f"Epoch {epoch}'s weights are saved (a resume reads the step checkpoints in checkpoints/, not these)."
    return re.sub(r"^Adapter checkpoint (of size .* saved to .*adapter_config\.json)$", r"Adapter config \1", line)
