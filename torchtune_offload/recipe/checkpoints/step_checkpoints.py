"""Resumable checkpoints at any step, written so that a crash cannot leave a half checkpoint.

Each checkpoint is a folder ``<output_dir>/checkpoints/step_<global step>/`` holding:

- ``model.safetensors``: the trained weights in the model's own names (full fine-tuning: the
  whole model; LoRA: the adapters, the base weights being the frozen ones of ``checkpoint_dir``);
- ``training_state.pt``: where training stands (epoch, step, seed), the optimizer state (an
  offloading optimizer's host state included), the dataloader position and the RNG states;
- ``complete.json``: written last. It holds the checkpoint's id, which the other two files carry
  too, and their sizes: a folder without it, or whose files do not match it, is not a checkpoint.
  It also holds what a resume is checked against before any weight is read: the rank count and
  the batching (``batch_size`` and ``gradient_accumulation_steps``) of the run that wrote it.

A save writes a staging folder, flushes it to disk and renames it into place, then removes the
oldest checkpoints beyond ``keep_last``. At any moment the newest complete checkpoint is loadable.
torchtune's ``epoch_<N>/`` folders (Hugging Face format, for inference and export) are written as
before at each epoch's end; these checkpoints are what ``resume_from_checkpoint=True`` reads.
"""

import json
import random
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torchtune import utils

from torchtune_offload.recipe.checkpoints.atomic_save import fsync_tree

CHECKPOINTS_DIR = "checkpoints"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
MANIFEST_FILE = "complete.json"
_NAME = re.compile(r"^step_(\d+)$")
_STAGING_PREFIX = ".saving_step_"
#: A checkpoint being deleted is renamed to this first, so a kill mid-deletion never leaves a
#: ``step_*`` folder with part of its files (which no listing would see again, nor remove).
_DELETING_PREFIX = ".deleting_step_"

log = utils.get_logger("INFO")


def checkpoint_folder(output_dir: Any, global_step: int) -> Path:
    """Where the checkpoint of ``global_step`` is (or would be) in ``output_dir``."""
    return Path(str(output_dir)) / CHECKPOINTS_DIR / f"step_{global_step:08d}"


def rng_states() -> Dict[str, Any]:
    """Every random number generator training may draw from (dropout, data order, augmentations)."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: Dict[str, Any]) -> None:
    """Puts back what :func:`rng_states` saved."""
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


@dataclass(frozen=True)
class ResumePoint:
    """A complete checkpoint, checked, with its training state loaded.

    Attributes:
        path: the checkpoint folder.
        global_step: optimizer steps done when it was saved.
        epoch: the epoch training was in (0-based).
        step_in_epoch: optimizer steps done in that epoch (0: it starts).
        run_id: the run that wrote it.
        state: what ``training_state.pt`` holds.
    """

    path: Path
    global_step: int
    epoch: int
    step_in_epoch: int
    run_id: str
    state: Dict[str, Any]

    def load_weights_into(self, model: torch.nn.Module, *, names: List[str]) -> None:
        """Copies the saved weights into ``model``, tensor by tensor (no second copy of the model).

        Args:
            model: the model, its other weights already loaded.
            names: the state-dict names the checkpoint must hold, no more and no fewer.

        Raises:
            ValueError: if the saved names or shapes differ from the model's.
        """
        target = model.state_dict()
        with safe_open(self.path / WEIGHTS_FILE, framework="pt") as f:
            saved = set(f.keys())
            missing, unexpected = sorted(set(names) - saved), sorted(saved - set(names))
            if missing or unexpected:
                raise ValueError(
                    f"resume_from_checkpoint=True: {self.path} does not hold this model's trained weights "
                    f"(missing {missing[:3]}, unexpected {unexpected[:3]}); it was written for another model "
                    "or LoRA setting. Resume with the config that wrote it, or start fresh in a new output_dir."
                )
            with torch.no_grad():
                for name in names:
                    tensor = f.get_tensor(name)
                    if tensor.shape != target[name].shape:
                        raise ValueError(f"resume_from_checkpoint=True: {self.path}: {name} is "
                                         f"{list(tensor.shape)} there and {list(target[name].shape)} in the model.")
                    target[name].copy_(tensor)


def rank_staging(output_dir: Any, global_step: int) -> Path:
    """Where each rank writes its own file for the save of ``global_step`` before rank 0 moves it
    into the checkpoint (a kill before that leaves it to :meth:`StepCheckpoints.prune`)."""
    return Path(output_dir) / CHECKPOINTS_DIR / f"{_STAGING_PREFIX}ranks_{global_step:08d}"


class StepCheckpoints:
    """The resumable checkpoints of one ``output_dir``.

    Args:
        output_dir: the run's output folder.
        keep_last: how many complete checkpoints to keep; older ones are removed after each save.
        run_id: identifies the run writing checkpoints (a resumed run keeps its checkpoint's).
            A save removes the checkpoints of other runs, which a run told to overwrite them
            (``overwrite_checkpoints=True``) leaves until it has one of its own.
    """

    def __init__(self, output_dir: Any, *, keep_last: int, run_id: Optional[str] = None) -> None:
        self.root = Path(str(output_dir)) / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.run_id = run_id or uuid.uuid4().hex

    def complete(self) -> List[Path]:
        """The complete checkpoints, oldest first."""
        return complete_checkpoints(self.root.parent)

    def save(self, *, global_step: int, epoch: int, step_in_epoch: int, weights: Dict[str, torch.Tensor],
             state: Dict[str, Any], ranks: Optional[int] = None,
             batching: Optional[Dict[str, int]] = None, optimizer: Optional[Dict[str, Any]] = None,
             rank_files: Sequence[Path] = ()) -> Path:
        """Writes one checkpoint atomically and removes the ones beyond ``keep_last``.

        Args:
            global_step: optimizer steps done.
            epoch: the epoch training is in (0-based): the one to continue.
            step_in_epoch: optimizer steps done in ``epoch``.
            weights: the trained weights by state-dict name (on any device).
            state: the rest of the training state (tensors may be on any device).
            ranks: the distributed recipe's rank count (its state holds each rank's position);
                ``None`` for a single-device recipe's checkpoint.
            batching: the run's ``batch_size`` and ``gradient_accumulation_steps`` (its data
                position and step counts are in their units); ``None`` where unknown (tests).
            optimizer: the run's optimizer class and base optimizer class (``resume.optimizer_identity``:
                the optimizer state is theirs); ``None`` where unknown.
            rank_files: files each rank wrote for this save (its optimizer state, on FSDP2's shards:
                :func:`rank_staging`), moved into the checkpoint and listed in its manifest.

        Returns:
            The checkpoint folder.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f"{_STAGING_PREFIX}{global_step:08d}"
        shutil.rmtree(staging, ignore_errors=True)  # a crashed earlier attempt at this save
        staging.mkdir()
        checkpoint_id = uuid.uuid4().hex
        # safetensors refuses tensors that share memory (tied weights): each entry gets its own copy.
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()},
                  staging / WEIGHTS_FILE, metadata={"checkpoint_id": checkpoint_id})
        torch.save({**state, "checkpoint_id": checkpoint_id}, staging / STATE_FILE)
        for path in rank_files:
            path.rename(staging / path.name)
        manifest = {
            "checkpoint_id": checkpoint_id, "run_id": self.run_id, "global_step": global_step, "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "files": {f: (staging / f).stat().st_size for f in (WEIGHTS_FILE, STATE_FILE, *(p.name for p in rank_files))},
        }
        if ranks is not None:
            manifest["ranks"] = ranks
        if batching is not None:
            manifest["batching"] = dict(batching)
        if optimizer is not None:
            manifest["optimizer"] = dict(optimizer)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
        fsync_tree(staging)
        final = checkpoint_folder(self.root.parent, global_step)
        if final.exists():  # the same step saved again (a resumed run that repeats it)
            shutil.rmtree(final)
        staging.rename(final)
        fsync_tree(self.root, files=False)
        self.prune()
        return final

    def prune(self) -> None:
        """Removes other runs' checkpoints, this run's beyond ``keep_last`` (oldest first), and
        the leftovers of interrupted saves and deletions."""
        # Leftovers of interrupted saves and deletions first: a deletion's name may be taken again.
        for stale in [*self.root.glob(f"{_STAGING_PREFIX}*"), *self.root.glob(f"{_DELETING_PREFIX}*")]:
            shutil.rmtree(stale, ignore_errors=True)
        mine = []
        for path in self.complete():
            if json.loads((path / MANIFEST_FILE).read_text()).get("run_id") == self.run_id:
                mine.append(path)
            else:
                self._remove(path)
        for old in mine[: -self.keep_last]:
            self._remove(old)

    def _remove(self, path: Path) -> None:
        doomed = self.root / (_DELETING_PREFIX + path.name[len("step_"):])  # prune cleared any leftover
        path.rename(doomed)  # atomic: the checkpoint is whole or gone
        shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def load(path: Path) -> ResumePoint:
        """Checks that a checkpoint's files belong together and loads its training state.

        Raises:
            ValueError: if the folder is incomplete, or its files were not written by one save.
        """
        problem = f"resume_from_checkpoint=True: {path} cannot be resumed from"
        try:
            manifest = json.loads((path / MANIFEST_FILE).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{problem}: its {MANIFEST_FILE} is missing or unreadable ({err}). Delete the "
                             "folder to resume from the one before it.") from err
        for name, size in manifest["files"].items():
            actual = (path / name).stat().st_size if (path / name).is_file() else None
            if actual != size:
                raise ValueError(f"{problem}: {name} has {actual} bytes, the save wrote {size}. Delete the "
                                 "folder to resume from the one before it.")
        with safe_open(path / WEIGHTS_FILE, framework="pt") as f:
            weights_id = (f.metadata() or {}).get("checkpoint_id")
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        ids = {manifest["checkpoint_id"], weights_id, state.get("checkpoint_id")}
        if len(ids) != 1:
            raise ValueError(f"{problem}: its weights, training state and {MANIFEST_FILE} come from different "
                             "saves. Delete the folder to resume from the one before it.")
        if "batching" not in manifest:
            log.warning(f"{path} does not record the batch_size and gradient_accumulation_steps it was saved with "
                        "(an earlier version wrote it), so they are not checked: resume with the values it was "
                        "saved with, or its data position and LR schedule are off.")
        return ResumePoint(path=path, global_step=manifest["global_step"], epoch=manifest["epoch"],
                           step_in_epoch=manifest["step_in_epoch"], run_id=manifest["run_id"], state=state)


def read_manifest(path: Path) -> Dict[str, Any]:
    """A complete checkpoint's manifest, read alone (no weight): what a resume is checked against
    first. Its ``ranks`` (the distributed recipe's rank count) is absent from a single-device
    recipe's checkpoint, and its ``batching`` (``batch_size`` and ``gradient_accumulation_steps``)
    and ``optimizer`` (the optimizer's classes) from one written before they were recorded."""
    return json.loads((path / MANIFEST_FILE).read_text())


def describe(point: ResumePoint, *, steps_per_epoch: int) -> str:
    """One log line naming the checkpoint resumed from and where training continues."""
    return (f"Resuming from {point.path} (global step {point.global_step}): epoch {point.epoch + 1}, "
            f"step {point.step_in_epoch} of {steps_per_epoch} done.")


def complete_checkpoints(output_dir: Any) -> List[Path]:
    """The complete checkpoints in ``output_dir``, oldest first."""
    root = Path(str(output_dir)) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()
             and (p / MANIFEST_FILE).is_file()]
    return [p for _, p in sorted(found)]


def newest_checkpoint(output_dir: Any) -> Optional[Path]:
    """The newest complete checkpoint in ``output_dir``, if any."""
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None


def checkpoint_folders(output_dir: Any) -> List[str]:
    """The names of the resumable checkpoint folders in ``output_dir`` (complete or not)."""
    root = Path(str(output_dir)) / CHECKPOINTS_DIR
    return sorted(p.name for p in root.iterdir() if _NAME.match(p.name)) if root.is_dir() else []
