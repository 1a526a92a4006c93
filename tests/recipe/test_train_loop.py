"""train_loop: the loop freezes what setup made while it trains (Python's full collections then
leave it alone) and hands it back to the collector however it ends."""

import gc
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.recipe.cpu_setup import cpu_recipe_setup
from tests.recipe_harness import REPO, load_recipe_module, tiny_asset_overrides
from torchtune_offload.recipe import TrainingDivergedError, train_loop

_cpu_setup = pytest.fixture(autouse=True, scope="module")(cpu_recipe_setup)


def _run(assets: Path, out: Path, *overrides: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / "full.yaml"), OmegaConf.from_dotlist(
        [f"output_dir={out}", *tiny_asset_overrides(assets), "max_steps_per_epoch=2", "batch_size=4", *overrides]))
    recipe = load_recipe_module("full_finetune_single_device").FullFinetuneRecipeSingleDevice(cfg)
    try:
        recipe.setup(cfg)
        recipe.train()
    finally:
        recipe.cleanup()


@pytest.mark.parametrize("diverges", [False, True], ids=["finished", "diverged"])
def test_setup_is_frozen_while_training_and_unfrozen_after(monkeypatch, tiny_assets, tmp_path, diverges):
    assert gc.get_freeze_count() == 0
    frozen = []
    window = train_loop.TrainLoop._window

    def counted(self, batches):
        frozen.append(gc.get_freeze_count())
        return window(self, batches)

    monkeypatch.setattr(train_loop.TrainLoop, "_window", counted)
    if diverges:
        with pytest.raises(TrainingDivergedError):
            _run(tiny_assets, tmp_path, "optimizer.lr=1e37", "lr_scheduler.num_warmup_steps=0")
    else:
        _run(tiny_assets, tmp_path)
    # Every step ran with the model, the optimizer and the data frozen; none of it stays frozen.
    assert frozen and all(n > 10_000 for n in frozen)
    assert gc.get_freeze_count() == 0
