"""The engine options only this project's recipes drive, refused where torchtune's own recipe runs."""

import sys
import types
from pathlib import Path

import pytest
import torch
import torchtune

from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.optim import driver_check

TORCHTUNE_RECIPES = Path(torchtune.__file__).resolve().parent.parent / "recipes"


def _as_main(monkeypatch, path: Path) -> None:
    """Makes ``path`` the running program's file, as ``tune run`` (runpy) and torchrun make a recipe's."""
    main = types.ModuleType("__main__")
    main.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", main)


def _params():
    return [torch.nn.Parameter(torch.randn(64, 64))]


@pytest.mark.parametrize("recipe", ["full_finetune_single_device", "lora_finetune_single_device",
                                    "full_finetune_distributed"])
def test_torchtune_recipes_are_recognised(monkeypatch, recipe):
    _as_main(monkeypatch, TORCHTUNE_RECIPES / f"{recipe}.py")
    assert driver_check.torchtune_recipe_running() == recipe


def test_this_projects_recipes_and_other_programs_are_not(monkeypatch):
    repo = Path(__file__).resolve().parents[2]
    for path in (repo / "recipes" / "full_finetune_single_device.py", Path("/tmp/train.py")):
        _as_main(monkeypatch, path)
        assert driver_check.torchtune_recipe_running() is None
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))  # an interactive interpreter
    assert driver_check.torchtune_recipe_running() is None


@pytest.mark.parametrize("options,named", [({"offload_gradients": True}, ["optimizer.offload_gradients=True"]),
                                           ({"overlap": True}, ["optimizer.overlap=True"]),
                                           ({"offload_gradients": True, "overlap": True},
                                            ["optimizer.offload_gradients=True", "optimizer.overlap=True"])])
def test_under_torchtunes_recipe_the_options_it_cannot_drive_are_refused(monkeypatch, options, named):
    _as_main(monkeypatch, TORCHTUNE_RECIPES / "full_finetune_single_device.py")
    with pytest.raises(ValueError) as err:
        OffloadOptimizer(_params(), "torch.optim.AdamW", minimal_size=0, **options)
    message = str(err.value)
    assert all(key in message for key in named)
    assert "torchtune's own recipe full_finetune_single_device" in message
    assert "tune-offload run full_finetune_single_device --config <config>" in message
    # The optimizer alone is exact under torchtune's recipe, and is built.
    OffloadOptimizer(_params(), "torch.optim.AdamW", minimal_size=0)


def test_fp8_device_weights_are_refused_under_torchtunes_recipe(monkeypatch):
    _as_main(monkeypatch, TORCHTUNE_RECIPES / "full_finetune_single_device.py")
    with pytest.raises(ValueError, match=r"optimizer.device_weights=fp8: it never binds the model"):
        OffloadOptimizer(_params(), "torch.optim.AdamW", minimal_size=0, device_weights="fp8")


def test_elsewhere_the_options_are_taken(monkeypatch):
    _as_main(monkeypatch, Path("/tmp/train.py"))
    opt = OffloadOptimizer(_params(), "torch.optim.AdamW", minimal_size=0, offload_gradients=True, overlap=True)
    assert opt.offload_gradients and opt.overlap


def test_torchaos_wrapper_refuses_offload_gradients_under_torchtunes_recipe(monkeypatch):
    """torchao's optimizer frees the device gradients with offload_gradients as well (docs/gradient_math.md)."""
    _as_main(monkeypatch, TORCHTUNE_RECIPES / "full_finetune_single_device.py")
    with pytest.raises(ValueError, match=r"CPUOffloadOptimizer under torchtune's own recipe "
                                         r"full_finetune_single_device: optimizer.offload_gradients=True"):
        CPUOffloadOptimizer(_params(), "torch.optim.AdamW", offload_gradients=True)
