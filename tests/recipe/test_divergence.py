"""A run that diverges stops at its first non-finite step and leaves only finite checkpoints.

The recipes run for real on the tiny assets. ``optimizer.lr=1e37`` makes AdamW's first update move
every weight by about 1e37 (still finite in fp32), so the second step's forward overflows: its
gradient norm, or its loss, is nan. With a checkpoint after every step, the run must stop at step
2, name the step and the optimizer, and leave step 1's checkpoint, with finite weights, as the
newest on disk.
"""

import math
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from tests import zygote
from tests.optim.test_fp8_weights import build, layered
from tests.recipe.cpu_setup import cpu_recipe_setup
from tests.recipe_harness import REPO, TUNE, load_recipe_module, tiny_asset_overrides, working_tree_env
from torchtune_offload.recipe import Progress, TrainingDivergedError, read_disk_log
from torchtune_offload.recipe.checkpoints.step_checkpoints import WEIGHTS_FILE, StepCheckpoints, complete_checkpoints
from torchtune_offload.recipe.divergence import DivergenceGuard, nonfinite_parameters

RECIPES = {"full": ("full_finetune_single_device", "FullFinetuneRecipeSingleDevice"),
           "lora": ("lora_finetune_single_device", "LoRAFinetuneRecipeSingleDevice")}
# Four steps, a checkpoint after each; no warm-up, so the first step runs at the configured rate.
DIVERGE = ["max_steps_per_epoch=4", "batch_size=4", "save_every_n_steps=1", "lr_scheduler.num_warmup_steps=0",
           "optimizer.lr=1e37"]
OFFLOAD = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW"]


_cpu_setup = pytest.fixture(autouse=True, scope="module")(cpu_recipe_setup)


def _diverging_run(kind: str, assets: Path, out: Path, *overrides: str,
                   before_train: Optional[Callable[[Any], None]] = None):
    """Runs a recipe in-process that must stop with TrainingDivergedError; returns (recipe, message)."""
    module, cls = RECIPES[kind]
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / f"{kind}.yaml"), OmegaConf.from_dotlist(
        [f"output_dir={out}", *tiny_asset_overrides(assets), *DIVERGE, *overrides]))
    recipe = getattr(load_recipe_module(module), cls)(cfg)
    try:
        recipe.setup(cfg)
        if before_train is not None:
            before_train(recipe)
        with pytest.raises(TrainingDivergedError) as err:
            recipe.train()
    finally:
        recipe.cleanup()
    return recipe, str(err.value)


def _assert_only_finite_checkpoint_is(out: Path, step: int) -> None:
    """The run's checkpoints end at ``step``, which loads and holds finite weights."""
    newest = complete_checkpoints(out)[-1]
    assert newest.name == f"step_{step:08d}", complete_checkpoints(out)
    assert StepCheckpoints.load(newest).global_step == step
    weights = load_file(newest / WEIGHTS_FILE)
    assert weights and all(torch.isfinite(w).all() for w in weights.values())


@pytest.mark.parametrize("kind, overrides", [
    ("full", []),
    ("lora", [*OFFLOAD, "optimizer.minimal_size=256"]),
])
def test_a_diverging_run_stops_at_its_first_nonfinite_step(kind, overrides, tiny_assets, tmp_path):
    recipe, message = _diverging_run(kind, tiny_assets, tmp_path, *overrides)
    losses, rows = recipe._loop.losses, read_disk_log(tmp_path)
    # Step 1 was finite and saved; step 2 was not, and is the last one trained and logged.
    assert len(losses) == 2 and math.isfinite(losses[0]) and [r["step"] for r in rows] == [1, 2]
    assert not (math.isfinite(rows[1]["loss"]) and math.isfinite(rows[1]["grad_norm"]))
    assert "diverged at step 2 (epoch 1, step 2 of 4)" in message
    assert f"optimizer {recipe._optimizer.name}:" in message
    assert str(tmp_path / "checkpoints" / "step_00000001") in message and "resume_from_checkpoint=True" in message
    _assert_only_finite_checkpoint_is(tmp_path, 1)


def test_weights_that_turn_nonfinite_are_never_saved(tiny_assets, tmp_path):
    """Step 2's loss and norm are finite, but its update leaves a nan in a weight: its save is refused."""
    def poison_after_step_2(recipe):
        opt = recipe._optimizer.optimizer
        param = next(p for p in recipe._model.parameters() if p.requires_grad)

        def hook(optimizer, args, kwargs):
            if recipe.progress.global_step == 1:  # advanced after step() returns: this is step 2
                with torch.no_grad():
                    param.view(-1)[0] = float("nan")
        opt.register_step_post_hook(hook)

    recipe, message = _diverging_run("full", tiny_assets, tmp_path, "optimizer.lr=3e-3",
                                     before_train=poison_after_step_2)
    assert all(math.isfinite(x) for x in recipe._loop.losses) and len(recipe._loop.losses) == 2
    assert "diverged at step 2" in message and "1 trainable parameter(s) hold nan or inf (tok_embeddings.weight)" \
        in message and "optimizer AdamW:" in message
    _assert_only_finite_checkpoint_is(tmp_path, 1)


def test_update_on_device_diverging_exits_nonzero_from_tune_run(tiny_assets, tmp_path):
    """The H100 case (2026-11-22): ``update_on: device`` trained on to nan and the process succeeded."""
    cmd = [*TUNE, "run", "recipes/full_finetune_single_device.py", "--config", "configs/tiny/full.yaml",
           f"output_dir={tmp_path}", *tiny_asset_overrides(tiny_assets), *DIVERGE, *OFFLOAD,
           "optimizer.minimal_size=1024", "optimizer.update_on=device", "optimizer.overlap=True"]
    result = zygote.run(cmd, cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True,
                            text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert ("TrainingDivergedError: Training diverged at step 2 (epoch 1, step 2 of 4) with optimizer "
            "OffloadOptimizer (offload; base AdamW; overlap, update_on=device):") in output, output[-3000:]
    _assert_only_finite_checkpoint_is(tmp_path, 1)


def _progress(*, epochs_run: int = 0, steps_run: int = 0) -> Progress:
    return Progress(seed=0, epochs_run=epochs_run, total_epochs=2, max_steps_per_epoch=None,
                    steps_run_in_epoch=steps_run, windows_per_epoch=4)


def test_the_message_names_the_last_checkpoint_or_that_there_is_none(tmp_path):
    p = _progress()
    guard = DivergenceGuard(optimizer_name="SGD", progress=p, output_dir=tmp_path)
    p.advance()
    guard.check_step(loss=2.5, grad_norm=1.0)
    guard.check_step(loss=2.5, grad_norm=None)  # optimizer_in_bwd measures no norm
    with pytest.raises(TrainingDivergedError, match=r"step 1 .*optimizer SGD: the loss is inf and the gradient "
                       r"norm not measured .* No checkpoint was written before it"):
        guard.check_step(loss=math.inf, grad_norm=None)
    for _ in range(3):
        p.advance()
    p.finish_epoch()
    guard.saved()  # an epoch's end: its step checkpoint and epoch_0
    p.advance()
    with pytest.raises(TrainingDivergedError) as err:
        guard.check_step(loss=1.0, grad_norm=math.nan)
    assert "step 5 (epoch 2, step 1 of 4)" in str(err.value) and "gradient norm nan" in str(err.value)
    assert f"{tmp_path / 'checkpoints' / 'step_00000004'} (step 4, written by this run), and " \
           f"{tmp_path / 'epoch_0'} holds that epoch's weights" in str(err.value)
    # A resumed run that has saved nothing yet names the checkpoint it resumed from.
    resumed = DivergenceGuard(optimizer_name="SGD", progress=_progress(steps_run=2), output_dir=tmp_path)
    with pytest.raises(TrainingDivergedError, match=r"step_00000002 \(step 2, the checkpoint this run resumed from\)"):
        resumed.check_step(loss=math.nan, grad_norm=1.0)


def test_nonfinite_parameters_finds_nan_and_inf_in_trainable_weights_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, dtype=torch.bfloat16),
                                torch.nn.Linear(4, 4))
    assert nonfinite_parameters(model) == []
    with torch.no_grad():
        model[0].bias[2] = float("nan")
        model[1].weight[1, 1] = -float("inf")
        model[2].weight[0, 0] = float("inf")
    model[2].weight.requires_grad_(False)  # frozen (a LoRA base weight): never trained, never saved
    assert nonfinite_parameters(model) == ["0.bias", "1.weight"]
    guard = DivergenceGuard(optimizer_name="AdamW", progress=_progress(steps_run=3), output_dir=Path("out"))
    with pytest.raises(TrainingDivergedError, match=r"step 3 .*2 trainable parameter\(s\) hold nan or inf "
                       r"\(0.bias, 1.weight\)"):
        guard.check_weights(model)


def test_nonfinite_parameters_reads_the_host_masters_of_fp8_device_weights():
    """With device_weights=fp8 a layer's device weight is a one-element placeholder: the check must
    read the master the checkpoint saves, not the placeholder's zero."""
    model = layered()
    opt = build(model)
    assert nonfinite_parameters(model) == []
    slot = next(s for s in opt._weights.held if s.key == "layers.1.down.weight")
    with torch.no_grad():
        slot.step_param.view(-1)[5] = float("nan")
    assert nonfinite_parameters(model) == ["layers.1.down.weight"]
    opt.close()


@pytest.mark.gpu
def test_nonfinite_parameters_finds_nan_and_inf_on_the_accelerator():
    # The device's min/max reductions must propagate a nan from any block of a large weight.
    device = torch.accelerator.current_accelerator()
    model = torch.nn.Sequential(torch.nn.Linear(4096, 1024, dtype=torch.bfloat16),
                                torch.nn.Linear(1024, 4096, dtype=torch.float16)).to(device)
    assert nonfinite_parameters(model) == []
    with torch.no_grad():
        model[0].weight[1000, 4000] = float("nan")  # (out, in) = (1024, 4096): a late block
        model[1].weight[0, 0] = -float("inf")
    assert nonfinite_parameters(model) == ["0.weight", "1.weight"]
