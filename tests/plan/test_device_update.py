"""The planner and update_on=device: the staging on the device, the states alone on the host, the
issue's two targets, and its advice on where the update should run."""

import json
import sys

import pytest

from tests import zygote
from tests.recipe_harness import tiny_asset_overrides, working_tree_env
from tests.plan.test_planner import REPO

GIB = 1024**3


def _plan(tmp_path, config, *args):
    out = tmp_path / "plan.json"
    proc = zygote.run([sys.executable, "-m", "torchtune_offload.plan", "--config", config, "--force", "--json",
                       str(out),
                           "--no-fine-tunes", *args], cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, {p["name"]: p for p in json.loads(out.read_text())["plans"]}


@pytest.mark.parametrize("device_gib, advice", [
    ("1", "the weights and gradients fit the device, so optimizer.update_on=device is the better choice"),
    ("0.001", "the weights and gradients do not fit the device (offload_device_update: "),
])
def test_advice_says_where_the_update_should_run(tiny_assets, tmp_path, device_gib, advice):
    stdout, plans = _plan(tmp_path, "configs/tiny/full.yaml", *tiny_asset_overrides(tiny_assets),
                          f"output_dir={tmp_path}", "device=cuda", "--variants", "offload_device_update,offload_grads",
                          "--device-gib", device_gib, "--host-gib", "64")
    assert "Where the update runs: " in stdout and advice in stdout, stdout
    device, host = plans["offload_device_update"], plans["offload_grads"]
    # The states are on the host (all it holds besides the process); the device holds two staging buffers.
    assert device["device_parts"]["state staging (update_on=device)"] > 0
    assert set(device["host_parts"]) == {"this process (Python, PyTorch, torchtune)", "training: optimizer state (pinned)"}
    assert device["host_bytes"] < host["host_bytes"]


@pytest.mark.parametrize("config, device_gib, host_limit_gib", [
    ("configs/llama3_2/3B_full_offload_device_update.yaml", 24, 13),
    ("configs/llama3_1/8B_full_offload_device_update.yaml", 48, 31),
])
def test_the_shipped_configs_meet_the_issue_targets(tmp_path, config, device_gib, host_limit_gib):
    _, plans = _plan(tmp_path, config, "--variants", "config", "--device-gib", str(device_gib), "--host-gib", "128")
    plan = plans["config"]
    assert plan["problem"] is None
    assert plan["device_bytes"] <= device_gib * GIB
    assert plan["host_bytes"] <= host_limit_gib * GIB
    # Two staging buffers of 128 MiB (the default bound of 256 MiB), the states alone on the host.
    assert plan["device_parts"]["state staging (update_on=device)"] <= 256 * 2**20
    assert set(plan["host_parts"]) == {"this process (Python, PyTorch, torchtune)",
                                       "training: optimizer state (pinned)"}


def test_sums_on_the_device_move_the_ring_from_the_host_to_the_device(tiny_assets, tmp_path):
    """grad_sum_on=device: the plan counts the ring's chunks on the device and none on the host, and
    the speed model reads the option."""
    common = [*tiny_asset_overrides(tiny_assets), f"output_dir={tmp_path}", "device=cuda",
              "gradient_accumulation_steps=3", "--variants", "offload_grads", "--device-gib", "1", "--host-gib", "64",
              "--machine", "h100_recorded"]
    _, host = _plan(tmp_path, "configs/tiny/full.yaml", *common)
    _, device = _plan(tmp_path, "configs/tiny/full.yaml", *common, "optimizer.grad_sum_on=device")
    host, device = host["offload_grads"], device["offload_grads"]
    ring = device["device_parts"]["gradient sum chunks (grad_sum_on=device)"]
    assert ring > 0 and "gradient sum chunks (grad_sum_on=device)" not in host["device_parts"]
    host_ring = {k: v for k, v in host["host_parts"].items() if "staging ring" in k}
    assert host_ring and not any("staging ring" in k for k in device["host_parts"])
    # Everything else the same (the process's own memory is measured, so it is left out).
    training = {k: v for k, v in host["host_parts"].items() if k.startswith("training") and k not in host_ring}
    assert training == {k: v for k, v in device["host_parts"].items() if k.startswith("training")}
    assert host["speed"]["parts"]["host_sums"] != device["speed"]["parts"]["host_sums"]
