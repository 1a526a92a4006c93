"""train_loop: the loop freezes what setup made while it trains (Python's full collections then
leave it alone) and hands it back to the collector however it ends; its progress bar shows each
step's own loss."""

import gc
import re
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from torchtune.utils import get_logger

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


def test_the_progress_bar_shows_each_steps_count_beside_its_own_loss(monkeypatch, tiny_assets, tmp_path, capsys):
    # Before, update() drew the bar with the new count and the previous step's loss, a line that a
    # log (no terminal) keeps: "1|3|Loss: 6.0267: 100%| 4/4". Every draw is kept here (tqdm skips
    # those less than 0.1 s apart, and the tiny steps are faster).
    class EveryDraw(train_loop.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, mininterval=0, miniters=1, **kwargs)

    monkeypatch.setattr(train_loop, "tqdm", EveryDraw)
    _run(tiny_assets, tmp_path, "max_steps_per_epoch=4")
    bars = re.findall(r"(\d+)\|(\d+)\|Loss: [\d.]+: +\d+%\|[^|]*\| (\d+)/4", capsys.readouterr().err)
    assert {int(count) for _, _, count in bars} == {1, 2, 3, 4}, bars
    assert all(step == count for _, step, count in bars), bars


def test_a_saves_lines_are_printed_on_their_own_after_the_bar_shows_its_step(monkeypatch, tiny_assets, tmp_path,
                                                                               capsys):
    # Before, a fast step's bar was not drawn (tqdm draws at most every 0.1 s) and the save's line was
    # printed onto the bar's: "1|1|Loss: 6.2614:  33%| 1/3 [...]Checkpoint saved to .../step_00000002".
    # torchtune's log handler writes to the stderr of its making; here, to the one the bar writes to.
    for handler in get_logger().handlers:
        monkeypatch.setattr(handler, "stream", sys.stderr)
    _run(tiny_assets, tmp_path, "max_steps_per_epoch=3", "save_every_n_steps=1")
    err = capsys.readouterr().err
    for step in (1, 2):
        saved = err.index(f"Checkpoint saved to {tmp_path / 'checkpoints' / f'step_{step:08d}'}")
        before = err[:saved]
        # On a line of its own (the bar cleared with a carriage return), after the bar at that step.
        assert before.endswith(("\n", "\r")), repr(before[-200:])
        bars = re.findall(r"(\d+)\|(\d+)\|Loss: [\d.]+: +\d+%\|[^|]*\| (\d+)/3", before)
        assert bars and bars[-1][1:] == (str(step), str(step)), bars
