"""The distributed recipe on two gloo ranks, killed with SIGKILL (at a random step, or in the
middle of a checkpoint write) and resumed with ``resume_from_checkpoint=True``, ends exactly as a
run that was never interrupted: the same losses and final weights, bit for bit.

Every run is ``tune run --nproc_per_node 2``. A kill takes the whole run down at once (the launcher
and both ranks), as a machine that fails does. For the kill inside a write, ``tune run`` launches a
wrapper of the recipe whose rank 0 kills the run once a checkpoint's files are flushed into its
staging folder and before they are renamed into place.
"""

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import List

import psutil
import pytest
import torch
from safetensors.torch import load_file

from tests import zygote
from tests.recipe_harness import TUNE, tiny_asset_overrides, working_tree_env
from torchtune_offload.recipe import read_disk_log
from torchtune_offload.recipe.checkpoints.step_checkpoints import StepCheckpoints, complete_checkpoints, read_manifest

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "tiny" / "full_distributed.yaml"
# Two epochs of 3 steps, two micro-batches each, clipped, a checkpoint after every step; keep 2 so
# that pruning runs too.
TRAIN = ["device=cpu", "epochs=2", "max_steps_per_epoch=3", "batch_size=4", "gradient_accumulation_steps=2",
         "clip_grad_norm=1.0", "save_every_n_steps=1", "keep_last_n_checkpoints=2"]
TOTAL_STEPS = 6

# Rank 0 kills the whole run (the launcher, its ranks, itself) after the files of its N-th step
# checkpoint are flushed and before they are renamed into place.
_KILL_IN_SAVE = """
import os, signal, sys
import psutil
sys.path.insert(0, os.environ["REPO"])
import torchtune_offload.recipe.checkpoints.step_checkpoints as sc
from tests.recipe_harness import load_recipe_module
flushed = sc.fsync_tree
count = {"saves": 0}
def fsync_then_die(root, files=True):
    flushed(root, files=files)
    if root.name.startswith(".saving_step_"):
        count["saves"] += 1
        if count["saves"] == int(os.environ["KILL_IN_SAVE"]):
            launcher = psutil.Process().parent()
            for proc in [p for p in launcher.children(recursive=True) if p.pid != os.getpid()] + [launcher]:
                proc.send_signal(signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
sc.fsync_tree = fsync_then_die
load_recipe_module("full_finetune_distributed").recipe_main()
"""


def _tune_run(script: str, assets: Path, out: Path, extra: List[str], log_name: str, *, cwd: Path = REPO,
              **env) -> zygote.Popen:
    """``tune run --nproc_per_node 2 <script>``; tune runs a script that is not its own as a module
    of ``cwd`` (``python -m``)."""
    cmd = [*TUNE, "run", "--nproc_per_node", "2", script, "--config", str(CONFIG), f"output_dir={out}",
           *tiny_asset_overrides(assets), *TRAIN, *extra, f"metric_logger.filename={log_name}"]
    return zygote.Popen(cmd, cwd=cwd, env=working_tree_env(MASTER_ADDR="127.0.0.1", REPO=str(REPO), **env),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: zygote.Popen) -> str:
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, output[-6000:]
    return output


def _losses(out: Path, log_name: str) -> dict:
    return {row["step"]: row["loss"] for row in read_disk_log(out / "logs" / log_name)}


def _kill_run(proc: zygote.Popen) -> None:
    """SIGKILL to the launcher and both ranks at once."""
    procs = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _assert_resumed_like_straight(out: Path, straight_dir: Path, output: str) -> None:
    resumed, straight = _losses(out, "resumed.txt"), _losses(straight_dir, "straight.txt")
    first = min(resumed)
    assert "Resuming from" in output and f"step_{first - 1:08d}" in output, output[-3000:]
    assert resumed == {step: straight[step] for step in range(first, TOTAL_STEPS + 1)}
    name = "model-00001-of-00001.safetensors"
    a, b = load_file(out / "epoch_1" / name), load_file(straight_dir / "epoch_1" / name)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _assert_every_complete_checkpoint_loads(out: Path) -> List[Path]:
    found = complete_checkpoints(out)
    assert found
    for path in found:
        point = StepCheckpoints.load(path)
        assert len(point.state["ranks"]) == 2 and "tok_embeddings.weight" in point.state["optimizer"]["state"]
        assert read_manifest(path)["batching"] == {"batch_size": 4, "gradient_accumulation_steps": 2}  # checked on resume
    return found


# A ``sitecustomize`` for the straight run's ranks: each says it started, and says so again (with its
# live gloo threads) if the interpreter finalizes, which a finished rank must not do
# (torchtune_offload/distributed/rank_exit.py).
_EXIT_PROBE = """
import atexit, os
if "RANK" in os.environ:
    rank = os.environ["RANK"]
    print(f"probe: rank {rank} started", flush=True)
    def finalizing():
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
        print(f"probe: rank {rank} finalizing, {sum('gloo' in n for n in names)} gloo threads alive", flush=True)
    atexit.register(finalizing)
"""


@pytest.fixture(scope="module")
def straight(tiny_assets, tmp_path_factory) -> Path:
    """The uninterrupted run; its output is kept beside it in ``output.txt``."""
    root = tmp_path_factory.mktemp("straight")
    (root / "probe").mkdir()
    (root / "probe" / "sitecustomize.py").write_text(_EXIT_PROBE)
    out = root / "run"
    path = working_tree_env()["PYTHONPATH"] + os.pathsep + str(root / "probe")
    output = _finish(_tune_run("recipes/full_finetune_distributed.py", tiny_assets, out, [], "straight.txt",
                               PYTHONPATH=path))
    (root / "output.txt").write_text(output)
    assert sorted(_losses(out, "straight.txt")) == list(range(1, TOTAL_STEPS + 1))
    return out


def test_a_finished_rank_ends_without_python_finalizing(straight):
    """After a finished run each rank leaves with os._exit: gloo's threads are still alive then, and
    one that needed the GIL while Python finalized aborted the rank (CI saw it twice)."""
    output = (straight.parent / "output.txt").read_text()
    assert "probe: rank 0 started" in output and "probe: rank 1 started" in output, output[-3000:]
    assert "finalizing" not in output, output[-3000:]


def test_sigkill_at_a_random_step_then_resume_is_exact(straight, tiny_assets, tmp_path):
    step = random.Random("distributed").randint(2, TOTAL_STEPS - 2)
    out = tmp_path / "run"
    proc = _tune_run("recipes/full_finetune_distributed.py", tiny_assets, out, [], "killed.txt")
    log, deadline = out / "logs" / "killed.txt", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and len(read_disk_log(log)) >= step:
            _kill_run(proc)  # it may be saving right then
            break
        time.sleep(0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself (rc {proc.returncode}) before step {step}"
    killed, straight_losses = _losses(out, "killed.txt"), _losses(straight, "straight.txt")
    assert killed == {s: straight_losses[s] for s in killed}
    before = _assert_every_complete_checkpoint_loads(out)
    output = _finish(_tune_run("recipes/full_finetune_distributed.py", tiny_assets, out,
                               ["resume_from_checkpoint=True"], "resumed.txt"))
    assert f"Resuming from {before[-1]}" in output
    _assert_resumed_like_straight(out, straight, output)
    # keep_last_n_checkpoints=2 held throughout: only the newest two remain.
    assert len(complete_checkpoints(out)) == 2


#: The engine on each rank's shards (``distributed/sharded_offload.py``), gradients offloaded and host steps
#: overlapped (a checkpoint then waits for the steps in flight), whose losses are plain AdamW's.
ENGINE = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
          "optimizer.minimal_size=0", "optimizer.offload_gradients=True", "optimizer.overlap=True"]


def test_the_engine_on_shards_killed_at_a_random_step_resumes_as_the_straight_adamw_run(straight, tiny_assets,
                                                                                        tmp_path):
    """Each rank's optimizer state is its own file in the checkpoint: killed and resumed, the run's
    losses and final weights are the straight run's (FSDP2 with torch's AdamW), bit for bit."""
    step = random.Random("distributed engine").randint(2, TOTAL_STEPS - 2)
    out = tmp_path / "run"
    proc = _tune_run("recipes/full_finetune_distributed.py", tiny_assets, out, ENGINE, "killed.txt")
    log, deadline = out / "logs" / "killed.txt", time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and len(read_disk_log(log)) >= step:
            _kill_run(proc)
            break
        time.sleep(0.01)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f"the run ended by itself (rc {proc.returncode}) before step {step}"
    for path in complete_checkpoints(out):  # each whole: its rank files are in its manifest, sizes checked
        point = StepCheckpoints.load(path)
        assert len(point.state["ranks"]) == 2
        assert point.state["optimizer"] == {"rank_files": ["optimizer_rank00000.pt", "optimizer_rank00001.pt"]}
    output = _finish(_tune_run("recipes/full_finetune_distributed.py", tiny_assets, out,
                               [*ENGINE, "resume_from_checkpoint=True"], "resumed.txt"))
    _assert_resumed_like_straight(out, straight, output)


def test_sigkill_inside_a_checkpoint_write_then_resume_is_exact(straight, tiny_assets, tmp_path):
    kill_at = random.Random("distributed save").randint(2, TOTAL_STEPS - 2)  # the save being written
    out = tmp_path / "run"
    wrapper = tmp_path / "kill_in_save.py"
    wrapper.write_text(_KILL_IN_SAVE)
    proc = _tune_run(wrapper.name, tiny_assets, out, [], "killed.txt", cwd=tmp_path, KILL_IN_SAVE=str(kill_at))
    output = proc.communicate(timeout=400)[0]
    assert proc.returncode == -signal.SIGKILL, output[-3000:]
    # The half-written save is a staging folder; the checkpoints in place are complete and load.
    assert list((out / "checkpoints").glob(".saving_step_*"))
    assert [p.name for p in _assert_every_complete_checkpoint_loads(out)][-1] == f"step_{kill_at - 1:08d}"
    output = _finish(_tune_run("recipes/full_finetune_distributed.py", tiny_assets, out,
                               ["resume_from_checkpoint=True"], "resumed.txt"))
    assert f"step_{kill_at - 1:08d}" in output
    _assert_resumed_like_straight(out, straight, output)
    assert not list((out / "checkpoints").glob(".saving_step_*"))
