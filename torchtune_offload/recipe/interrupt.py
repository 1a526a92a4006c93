"""Ctrl-C during a run: one line on where the run can go on from, instead of a traceback.

A run stopped by Ctrl-C (``KeyboardInterrupt``) still cleans up (the recipes' ``finally``), then
ends with exit status 130, as a shell reports an interrupted program, and says which complete
checkpoint ``resume_from_checkpoint=True`` would continue from, or that none was saved yet.
"""

import contextlib
import os
import sys
from typing import Iterator

from omegaconf import DictConfig

from torchtune_offload.recipe.checkpoints.resume import run_output_dir
from torchtune_offload.recipe.checkpoints.step_checkpoints import CHECKPOINTS_DIR, newest_checkpoint

#: The exit status of a program ended by SIGINT, as shells report it (128 + 2).
INTERRUPTED_STATUS = 130


def interrupted_message(cfg: DictConfig) -> str:
    """What a run stopped by Ctrl-C can do next, read from its output folder.

    Args:
        cfg: the recipe config.
    """
    out = run_output_dir(cfg)
    newest = newest_checkpoint(out)
    if newest is not None:
        return (f"Interrupted (Ctrl-C). The newest complete checkpoint is {newest}: run the same command with "
                "resume_from_checkpoint=True to continue from it exactly (later steps are done again).")
    every = cfg.get("save_every_n_steps")
    when = (f"every {every} steps" if every else
            "at each epoch's end only (save_every_n_steps=N saves every N steps as well)")
    return (f"Interrupted (Ctrl-C) before any checkpoint was complete in {out / CHECKPOINTS_DIR} (this config saves "
            f"{when}): run the command again to start over.")


@contextlib.contextmanager
def interrupt_reported(cfg: DictConfig) -> Iterator[None]:
    """Turns a ``KeyboardInterrupt`` inside the block into :func:`interrupted_message` on stderr
    (on rank 0 only, in a distributed run) and exit status 130.

    Args:
        cfg: the recipe config.

    Raises:
        SystemExit: with status 130 when interrupted.
    """
    try:
        yield
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", 0)) == 0:
            print(interrupted_message(cfg), file=sys.stderr, flush=True)
        raise SystemExit(INTERRUPTED_STATUS) from None
