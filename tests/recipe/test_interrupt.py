"""Ctrl-C during a run: cleaned up, exit status 130, one line naming the checkpoint to resume from."""

import signal
import subprocess
import time
from pathlib import Path

from omegaconf import OmegaConf

from tests import zygote
from tests.recipe_harness import TUNE, tiny_asset_overrides, working_tree_env
from torchtune_offload.recipe.checkpoints.step_checkpoints import newest_checkpoint
from torchtune_offload.recipe.interrupt import INTERRUPTED_STATUS, interrupted_message

REPO = Path(__file__).resolve().parents[2]


def test_before_any_checkpoint_the_message_says_when_this_config_saves(tmp_path):
    for every, said in ((None, "at each epoch's end only (save_every_n_steps=N saves every N steps as well)"),
                        (5, "every 5 steps")):
        message = interrupted_message(OmegaConf.create({"output_dir": str(tmp_path), "save_every_n_steps": every}))
        assert message.startswith("Interrupted (Ctrl-C) before any checkpoint was complete in ")
        assert f"(this config saves {said})" in message and "start over" in message


def test_ctrl_c_mid_run_names_the_newest_checkpoint_and_exits_130(tiny_assets, tmp_path):
    out = tmp_path / "run"
    cmd = [*TUNE, "run", "recipes/full_finetune_single_device.py", "--config", "configs/tiny/full.yaml",
           *tiny_asset_overrides(tiny_assets), "device=cpu", f"output_dir={out}", "save_every_n_steps=1",
           "max_steps_per_epoch=200", "epochs=1"]
    proc = zygote.Popen(cmd, cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and newest_checkpoint(out) is None:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its first checkpoint"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == INTERRUPTED_STATUS, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"Interrupted (Ctrl-C). The newest complete checkpoint is {out / 'checkpoints'}/step_"), last
    assert last.endswith("resume_from_checkpoint=True to continue from it exactly (later steps are done again).")
