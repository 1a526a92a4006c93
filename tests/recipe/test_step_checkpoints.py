"""Step checkpoints: complete or absent, tied together, pruned, and checked when loaded."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from torchtune_offload.recipe.checkpoints.step_checkpoints import (
    MANIFEST_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    StepCheckpoints,
    newest_checkpoint,
    restore_rng_states,
    rng_states,
)


def _save(store, step, value=0.0):
    return store.save(global_step=step, epoch=0, step_in_epoch=step,
                      weights={"w": torch.full((3,), float(value))}, state={"progress": {"step": step}})


def test_newest_complete_checkpoint_is_found_and_loaded(tmp_path):
    store = StepCheckpoints(tmp_path, keep_last=3)
    for step in (1, 2, 10):
        _save(store, step, value=step)
    # An interrupted save leaves a staging folder and a folder without its manifest: neither counts.
    (tmp_path / "checkpoints" / ".saving_step_00000011").mkdir()
    half = tmp_path / "checkpoints" / "step_00000012"
    shutil.copytree(tmp_path / "checkpoints" / "step_00000010", half)
    (half / MANIFEST_FILE).unlink()
    assert newest_checkpoint(tmp_path).name == "step_00000010"
    point = StepCheckpoints.load(newest_checkpoint(tmp_path))
    assert (point.global_step, point.epoch, point.step_in_epoch) == (10, 0, 10)
    assert point.state["progress"] == {"step": 10}
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3))
    point.load_weights_into(model, names=["w"])
    assert torch.equal(model.w.detach(), torch.full((3,), 10.0))


def test_only_the_newest_are_kept_and_other_runs_are_replaced(tmp_path):
    old_run = StepCheckpoints(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        _save(old_run, step)
    new_run = StepCheckpoints(tmp_path, keep_last=2)  # a fresh run told to overwrite
    assert [p.name for p in new_run.complete()] == ["step_00000001", "step_00000002", "step_00000003"]
    _save(new_run, 1)
    _save(new_run, 2)
    _save(new_run, 3)
    names = [p.name for p in new_run.complete()]
    assert names == ["step_00000002", "step_00000003"]
    assert {json.loads((tmp_path / "checkpoints" / n / MANIFEST_FILE).read_text())["run_id"] for n in names} == {
        new_run.run_id}


def test_a_kill_while_pruning_leaves_no_damaged_checkpoint_and_the_next_prune_finishes(tmp_path, monkeypatch):
    store = StepCheckpoints(tmp_path, keep_last=2)
    for step in (1, 2):
        _save(store, step)
    real_rmtree = shutil.rmtree

    def killed_half_way(path, *args, **kwargs):  # the process dies after one file of the oldest is gone
        if "step_00000001" not in str(path) or not path.exists():
            return real_rmtree(path, *args, **kwargs)
        next(p for p in sorted(path.iterdir())).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        _save(store, 3)
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    root = tmp_path / "checkpoints"
    # The half-deleted checkpoint is not a step_* folder any more; the others are whole.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == ["step_00000002", "step_00000003"]
    assert all((root / n / MANIFEST_FILE).is_file() for n in ("step_00000002", "step_00000003"))
    store.prune()
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000003"]
    # A leftover of a deletion does not stop a later deletion of a checkpoint of the same step.
    (root / ".deleting_step_00000002").mkdir()
    (root / ".deleting_step_00000002" / "x").write_text("left behind")
    fresh = StepCheckpoints(tmp_path, keep_last=2)  # another run: replaces these two
    _save(fresh, 5)
    assert sorted(p.name for p in root.iterdir()) == ["step_00000005"]


def test_files_of_different_saves_are_refused(tmp_path):
    store = StepCheckpoints(tmp_path, keep_last=3)
    a, b = _save(store, 1), _save(store, 2)
    shutil.copy(a / STATE_FILE, b / STATE_FILE)
    manifest = json.loads((b / MANIFEST_FILE).read_text())
    manifest["files"][STATE_FILE] = (b / STATE_FILE).stat().st_size
    (b / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="come from different saves"):
        StepCheckpoints.load(b)


def test_a_truncated_file_is_refused(tmp_path):
    path = _save(StepCheckpoints(tmp_path, keep_last=1), 1)
    data = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(data[:-8])
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE} has .* bytes, the save wrote"):
        StepCheckpoints.load(path)


def test_weights_of_another_model_are_refused(tmp_path):
    point = StepCheckpoints.load(_save(StepCheckpoints(tmp_path, keep_last=1), 1))
    model = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="does not hold this model's trained weights"):
        point.load_weights_into(model, names=["weight", "bias"])


def test_device_rng_states_are_saved_and_restored_where_a_gpu_is(monkeypatch, tmp_path):
    """The CUDA generators' states (dropout on the GPU) go into the checkpoint and back, through a
    file, one per device; a checkpoint from a GPU machine resumes on one without (nothing to set)."""
    devices = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [d.clone() for d in devices])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    torch.save(rng_states(), tmp_path / "rng.pt")
    loaded = torch.load(tmp_path / "rng.pt", weights_only=False)
    restore_rng_states(loaded)
    assert len(restored) == 1 and all(torch.equal(a, b) for a, b in zip(restored[0], devices))
    assert len(restored[0]) == len(devices)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restore_rng_states(loaded)
    assert len(restored) == 1


def test_rng_states_round_trip():
    saved = rng_states()
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng_states(saved)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
