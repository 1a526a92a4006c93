"""OffloadOptimizer under torchtune's own recipe (``tune run full_finetune_single_device``): the
optimizer alone trains; the options that need this project's recipes are refused, not ignored."""

import sys
from pathlib import Path

from tests import zygote
from tests.recipe_harness import tiny_asset_overrides, working_tree_env

REPO = Path(__file__).resolve().parents[2]
TORCHTUNE_RUN = [sys.executable, "-m", "torchtune._cli.tune", "run", "full_finetune_single_device",
                 "--config", str(REPO / "configs" / "tiny" / "full.yaml")]


def _run(tiny_assets, out: Path, *overrides: str):
    return zygote.run([*TORCHTUNE_RUN, *tiny_asset_overrides(tiny_assets), "device=cpu", "max_steps_per_epoch=2",
                       f"output_dir={out}", "optimizer._component_=torchtune_offload.OffloadOptimizer",
                       *overrides], cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=600)


def test_torchtunes_recipe_trains_with_the_optimizer_alone(tiny_assets, tmp_path):
    ran = _run(tiny_assets, tmp_path / "alone")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (tmp_path / "alone" / "epoch_0").is_dir()


def test_torchtunes_recipe_refuses_offload_gradients_before_training(tiny_assets, tmp_path):
    ran = _run(tiny_assets, tmp_path / "refused", "optimizer.offload_gradients=True", "gradient_accumulation_steps=2",
               "clip_grad_norm=1.0")
    assert ran.returncode != 0
    assert ("OffloadOptimizer under torchtune's own recipe full_finetune_single_device: "
            "optimizer.offload_gradients=True: it scales (1/num_tokens) and clips") in ran.stderr, ran.stderr[-3000:]
    assert "tune-offload run full_finetune_single_device --config <config>" in ran.stderr
    assert not (tmp_path / "refused" / "epoch_0").exists()
