"""The planner's predictions against measurement on the CPU: ``scripts/bench/plan_accuracy.py`` on the tiny
model and on the 78M-parameter Llama 3.2 (full, and QLoRA): host peak and training step."""

import re
import sys
from pathlib import Path

import pytest

from tests import zygote
from tests.recipe_harness import path_without, tiny_asset_overrides, working_tree_env

REPO = Path(__file__).resolve().parents[2]


def _accuracy(config: str, overrides) -> dict:
    cmd = [sys.executable, "scripts/bench/plan_accuracy.py", "--config", config, *overrides, "--steps", "3"]
    # No tune or tune-offload on PATH, as in a virtual environment that is not activated.
    env = working_tree_env(TIKTOKEN_CACHE_DIR="", PATH=path_without("tune", "tune-offload"))
    proc = zygote.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for label in ("peak host memory (RSS)", "training step (weights, gradients, activations)"):
        row = re.search(rf"^\| {re.escape(label)} \| ([0-9.]+) \| ([0-9.]+) \| ([+-][0-9.]+)% \|$", proc.stdout, re.M)
        assert row, proc.stdout
        predicted, measured, error = map(float, row.groups())
        assert predicted > 0 and measured > 0, proc.stdout
        rows[label] = (error, proc.stdout)
    return rows


def _assert_within_bounds(rows: dict) -> None:
    """The issue's bounds: host peak within 10% of the measured RSS, the step within 15%."""
    error, out = rows["peak host memory (RSS)"]
    assert abs(error) <= 10, out
    error, out = rows["training step (weights, gradients, activations)"]
    assert abs(error) <= 15, out


def test_tiny_host_within_10_percent_and_step_within_15_percent(tiny_assets):
    rows = _accuracy("configs/tiny/full.yaml", tiny_asset_overrides(tiny_assets))
    _assert_within_bounds(rows)


@pytest.fixture(scope="module")
def mid_overrides(tiny_assets, tmp_path_factory) -> list:
    """The 1B configs pointed at a random-init mid-size Llama 3.2 checkpoint (built once for the
    module: the QLoRA model reads the same checkpoint) and synthetic data."""
    mid = tmp_path_factory.mktemp("mid")
    built = zygote.run([sys.executable, "-m", "torchtune_offload.assets", "--real-arch", "llama3_2_mid",
                            "--output-dir", str(mid), "--no-check"], cwd=REPO, env=working_tree_env(),
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    tokenizer = tiny_assets / "tokenizer"
    return [
        f"checkpointer.checkpoint_dir={mid}", "checkpointer.checkpoint_files=[model.safetensors]",
        f"tokenizer.path={tokenizer / 'tokenizer.model'}", f"tokenizer.special_tokens_path={tokenizer / 'special_tokens.json'}",
        "dataset._component_=torchtune_offload.data.synthetic_dataset", "dataset.seq_len=256", "dataset.num_samples=64",
        "batch_size=1", "gradient_accumulation_steps=2",
    ]


def test_mid_size_llama_host_within_10_percent_and_step_within_15_percent(mid_overrides):
    rows = _accuracy("configs/llama3_2/1B_full_offload_engine.yaml", [
        *mid_overrides, "model._component_=torchtune_offload.models.llama3_2_mid"])
    _assert_within_bounds(rows)


def test_mid_size_qlora_run_step_and_host_within_10_percent(mid_overrides):
    # NF4 base weights, the LoRA recipe, OffloadOptimizer with offload_gradients: a real tune run.
    rows = _accuracy("configs/llama3_2/1B_lora_offload.yaml", [
        *mid_overrides, "model._component_=torchtune_offload.models.qlora_llama3_2_mid"])
    # The planner's figure for the run, its traced step (the device figure of a GPU run), within 10%.
    error, out = rows["training step (weights, gradients, activations)"]
    assert abs(error) <= 10, out
    # The host peak within 10% too (-1.8% here, -2.3% in a fresh virtual environment): the process
    # baseline runs a miniature training step of the run's kind (planner.miniature_step), whose
    # kernel code and caches the run holds from its first step; without it, -7.4% and -6.5%.
    error, out = rows["peak host memory (RSS)"]
    assert abs(error) <= 10, out
