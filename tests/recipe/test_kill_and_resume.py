"""A run killed with SIGKILL (at a random step, or in the middle of a save) and resumed with
``resume_from_checkpoint=True`` ends exactly as a run that was never interrupted.

Every run is a real child process: ``tune run`` for the straight and the randomly killed runs, and
for the kill during a save a child that runs the same recipe and kills itself once a checkpoint's
files are written but before they are renamed into place. The resumed run is ``tune run`` with
``resume_from_checkpoint=True`` and no path: it must find the newest complete checkpoint itself.
"""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest
import torch
from safetensors.torch import load_file

from tests import zygote
from tests.recipe_harness import TUNE, tiny_asset_overrides, working_tree_env
from torchtune_offload.recipe import read_disk_log

REPO = Path(__file__).resolve().parents[2]
RECIPES = {"full": "recipes/full_finetune_single_device.py", "lora": "recipes/lora_finetune_single_device.py"}
# Two epochs of 4 steps, each of two micro-batches, clipped, with a checkpoint after every step;
# keep 2 so that pruning runs too.
TRAIN = ["epochs=2", "max_steps_per_epoch=4", "batch_size=4", "gradient_accumulation_steps=2",
         "clip_grad_norm=0.5", "save_every_n_steps=1", "keep_last_n_checkpoints=2"]
OFFLOAD = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
           "optimizer.offload_gradients=True", "optimizer.overlap=True"]
CASES = {
    "full_offload": ("full", [*OFFLOAD, "optimizer.minimal_size=1024"]),
    "full_adamw": ("full", []),
    # 8-bit host states (uint8 codes and fp32 absmax per block) in the step checkpoints.
    "full_offload_8bit": ("full", [*OFFLOAD[:1], "optimizer.optimizer_class=torchtune_offload.AdamW8bit",
                                   *OFFLOAD[2:], "optimizer.minimal_size=1024"]),
    # States in host buffers, updated on the (emulated) device slice by slice, queued for the next forward.
    "full_device_update": ("full", [*OFFLOAD[:2], "optimizer.update_on=device", "optimizer.overlap=True",
                                    "optimizer.minimal_size=1024", "optimizer.device_staging_mib=0.25"]),
    "lora_offload": ("lora", [*OFFLOAD, "optimizer.minimal_size=256"]),
    "lora_adamw": ("lora", []),
}
TOTAL_STEPS = 8

# Runs the recipe as `tune run` would, but SIGKILLs itself after the files of its N-th step
# checkpoint are on disk and before they are moved into place.
_KILL_IN_SAVE = """
import os, signal, sys
import torchtune_offload.recipe.checkpoints.step_checkpoints as sc
from tests.recipe_harness import load_recipe_module
flushed = sc.fsync_tree
count = {"saves": 0}
def fsync_then_die(root, files=True):
    flushed(root, files=files)
    if root.name.startswith(".saving_step_"):
        count["saves"] += 1
        if count["saves"] == int(os.environ["KILL_IN_SAVE"]):
            os.kill(os.getpid(), signal.SIGKILL)
sc.fsync_tree = fsync_then_die
sys.argv = ["recipe", *sys.argv[1:]]
load_recipe_module(os.environ["RECIPE"]).recipe_main()
"""


def _command(kind: str, assets: Path, out: Path, extra: List[str], log_name: str) -> List[str]:
    return ["--config", f"configs/tiny/{kind}.yaml", f"output_dir={out}", *tiny_asset_overrides(assets), *TRAIN,
            *extra, f"metric_logger.filename={log_name}"]


def _tune_run(kind, assets, out, extra, log_name) -> zygote.Popen:
    cmd = [*TUNE, "run", RECIPES[kind], *_command(kind, assets, out, extra, log_name)]
    return zygote.Popen(cmd, cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, text=True)


def _finish(proc: zygote.Popen, *, expect_ok: bool = True) -> str:
    output = proc.communicate(timeout=600)[0]
    if expect_ok:
        assert proc.returncode == 0, output[-5000:]
    return output


def _losses(out: Path, log_name: str) -> dict:
    return {row["step"]: row["loss"] for row in read_disk_log(out / "logs" / log_name)}


def _final_weights(kind: str, out: Path) -> dict:
    name = "adapter_model.safetensors" if kind == "lora" else "model-00001-of-00001.safetensors"
    return load_file(out / "epoch_1" / name)


def _kill_at_step(proc: zygote.Popen, out: Path, log_name: str, step: int) -> None:
    """SIGKILLs the run as soon as it has logged ``step`` steps (it may be saving right then)."""
    log = out / "logs" / log_name
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and len(read_disk_log(log)) >= step:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself (rc {proc.returncode}) before step {step}"


def _assert_resumed_like_straight(kind, out, straight_dir, output: str) -> None:
    resumed = _losses(out, "resumed.txt")
    straight = _losses(straight_dir, "straight.txt")
    first = min(resumed)
    assert "Resuming from" in output and f"step_{first - 1:08d}" in output, output[-3000:]
    assert resumed == {step: straight[step] for step in range(first, TOTAL_STEPS + 1)}
    a, b = _final_weights(kind, out), _final_weights(kind, straight_dir)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def straight_runs(tiny_assets, tmp_path_factory):
    """The uninterrupted run of every case, two at a time."""
    root = tmp_path_factory.mktemp("straight")
    dirs = {name: root / name for name in CASES}
    names = list(CASES)
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        procs = [_tune_run(CASES[n][0], tiny_assets, dirs[n], CASES[n][1], "straight.txt") for n in pair]
        for proc in procs:
            _finish(proc)
    for name, out in dirs.items():
        assert sorted(_losses(out, "straight.txt")) == list(range(1, TOTAL_STEPS + 1)), name
    return dirs


@pytest.mark.parametrize("case", sorted(CASES))
def test_sigkill_at_a_random_step_then_resume_is_exact(case, straight_runs, tiny_assets, tmp_path):
    kind, extra = CASES[case]
    # Steps take milliseconds here: the kill lands at or a little after the chosen one.
    step = random.Random(case).randint(2, TOTAL_STEPS - 2)
    out = tmp_path / "run"
    _kill_at_step(_tune_run(kind, tiny_assets, out, extra, "killed.txt"), out, "killed.txt", step)
    killed = _losses(out, "killed.txt")
    straight = _losses(straight_runs[case], "straight.txt")
    assert killed == {s: straight[s] for s in killed}
    output = _finish(_tune_run(kind, tiny_assets, out, [*extra, "resume_from_checkpoint=True"], "resumed.txt"))
    _assert_resumed_like_straight(kind, out, straight_runs[case], output)
    # Under DiskLogger's own names (renaming keeps their times), the output_dir reads as the whole
    # run, as `tune-offload compare` shows it: the killed run's steps before the resumed ones.
    for name in ("killed.txt", "resumed.txt"):
        (out / "logs" / name).rename(out / "logs" / f"log_{name}")
    assert {row["step"]: row["loss"] for row in read_disk_log(out)} == straight
    # keep_last_n_checkpoints=2 held throughout: only the newest two remain.
    assert len(list((out / "checkpoints").glob("step_*"))) == 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_sigkill_during_a_save_then_resume_is_exact(case, straight_runs, tiny_assets, tmp_path):
    kind, extra = CASES[case]
    kill_at = random.Random(case).randint(2, TOTAL_STEPS - 2)  # the checkpoint save being written
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", _KILL_IN_SAVE, *_command(kind, tiny_assets, out, extra, "killed.txt")]
    env = working_tree_env(TIKTOKEN_CACHE_DIR="", KILL_IN_SAVE=str(kill_at), RECIPE=Path(RECIPES[kind]).stem)
    proc = zygote.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The half-written save is a staging folder; the checkpoints in place are all complete.
    assert list((out / "checkpoints").glob(".saving_step_*"))
    assert all((p / "complete.json").is_file() for p in (out / "checkpoints").glob("step_*"))
    output = _finish(_tune_run(kind, tiny_assets, out, [*extra, "resume_from_checkpoint=True"], "resumed.txt"))
    # The newest complete checkpoint is the one before the save that was killed.
    assert f"step_{kill_at - 1:08d}" in output
    _assert_resumed_like_straight(kind, out, straight_runs[case], output)
    assert not list((out / "checkpoints").glob(".saving_step_*"))
