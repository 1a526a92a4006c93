"""torchao's offloader (``torchtune_offload.CPUOffloadOptimizer``) in the single-device recipe, on the
CPU: torchao's own step with its streams and pinning stubbed (``tests/torchao_on_cpu.py``), so the
recipe's plumbing around it (the adapter ``build_optimizer`` picks, the norm it logs, the memory
report, checkpoints and resume) runs on any machine; against plain AdamW in the same recipe.
The GPU run is ``tests/recipe/test_recipes_gpu.py``."""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from tests.recipe.test_recipes import FP32, RESUME, _assert_same_tensors, _grad_norms, run_recipe
from tests.torchao_on_cpu import torchao_on_cpu
from torchtune_offload import CPUOffloadOptimizer
from torchtune_offload.optim.stream_check import checked_streams
from torchtune_offload.recipe import ConfigError, OptimizerKind, OwnGradientsOptimizer

AO = ["optimizer._component_=torchtune_offload.CPUOffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
      "optimizer.minimal_size=1024"]  # most tiny-model weights go to the host, the norms stay
# torchao cannot clip; the recipe normalises the loss before backward, so no scaling is missed.
EQUIV = ["max_steps_per_epoch=5", "batch_size=4", "clip_grad_norm=null"]


@pytest.fixture
def ao_on_cpu(monkeypatch):
    torchao_on_cpu(monkeypatch)


@pytest.fixture(autouse=True, scope="module")
def _two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


# torchao cannot accumulate with offload_gradients=True (the config check refuses it).
@pytest.mark.parametrize("offload_gradients, grad_accum", [(False, 2), (True, 1)])
@pytest.mark.parametrize("streams", ["done", "checked"])
def test_torchao_in_the_recipe_matches_plain_adamw(ao_on_cpu, tiny_assets, tmp_path: Path, offload_gradients,
                                                   grad_accum, streams, monkeypatch):
    """``checked``: torchao's streams and events are the stream checker's (tests/torchao_on_cpu.py), so
    every access of the recipe, torchao's hooks and its step is checked against CUDA's ordering rules."""
    settings = [*EQUIV, f"gradient_accumulation_steps={grad_accum}"]
    plain = run_recipe("full", tiny_assets, tmp_path / "plain", *settings)
    with contextlib.ExitStack() as stack:
        if streams == "checked":
            torchao_on_cpu(stack.enter_context(monkeypatch.context()),
                           streams=stack.enter_context(checked_streams()))
        ao = run_recipe("full", tiny_assets, tmp_path / "ao", *settings, *AO,
                        f"optimizer.offload_gradients={offload_gradients}")

    run = ao.recipe._optimizer
    assert isinstance(run.optimizer, CPUOffloadOptimizer) and run.optimizer.offload_gradients is offload_gradients
    assert type(run) is OwnGradientsOptimizer and run.kind is OptimizerKind.TORCHAO_OFFLOAD
    report = run.memory_report()
    assert report.num_offloaded > 0 and report.num_on_device > 0  # host and device steps both run
    assert len(ao.losses) == len(plain.losses) == 5
    # torchao's host step is torch's fused AdamW, plain AdamW's the for-loop: another order of operations.
    torch.testing.assert_close(torch.tensor(ao.losses), torch.tensor(plain.losses), **FP32)
    # The norm of the gradients stepped on, including those offload_gradients freed on the device.
    torch.testing.assert_close(_grad_norms(ao), _grad_norms(plain), **FP32)
    torch.testing.assert_close([r["lr"] for r in ao.log], [r["lr"] for r in plain.log])
    _assert_same_tensors(ao.params, plain.params, **FP32)
    assert ao.log[-1]["optimizer_host"] > 0  # the memory report reaches the log


def test_torchao_resume_after_epoch_is_exact(ao_on_cpu, tiny_assets, tmp_path: Path):
    """Its checkpoints are written and read back as torchao's kind, mid-run, with the same results."""
    settings = [*RESUME, "clip_grad_norm=null", *AO]
    straight = run_recipe("full", tiny_assets, tmp_path / "straight", *settings)
    killed = run_recipe("full", tiny_assets, tmp_path / "killed", *settings, stop_after_epoch=0)
    assert killed.losses == straight.losses[:4]
    resumed = run_recipe("full", tiny_assets, tmp_path / "killed", *settings, "resume_from_checkpoint=True")
    assert resumed.recipe._optimizer.kind is OptimizerKind.TORCHAO_OFFLOAD
    assert resumed.losses == straight.losses[4:]
    assert [r["grad_norm"] for r in resumed.log] == [r["grad_norm"] for r in straight.log[4:]]
    _assert_same_tensors(resumed.params, straight.params, rtol=0, atol=0)


def test_torchaos_checkpoint_is_refused_by_a_plain_run(ao_on_cpu, tiny_assets, tmp_path: Path):
    settings = [*RESUME, "clip_grad_norm=null"]
    run_recipe("full", tiny_assets, tmp_path, *settings, *AO, stop_after_epoch=0)
    # The manifest names torchao's wrapper: refused before any weight is read.
    with pytest.raises(ConfigError, match=r"was saved with optimizer._component_=torchtune_offload.optim.ao_offload."
                                          r"CPUOffloadOptimizer optimizer.optimizer_class=torch.optim.adamw.AdamW, "
                                          r"and this config has optimizer._component_=torch.optim.adamw.AdamW\."):
        run_recipe("full", tiny_assets, tmp_path, *settings, "resume_from_checkpoint=True")
    # A checkpoint that does not name its optimizer (written before the manifest did): refused as its state loads.
    manifest_file = tmp_path / "checkpoints" / "step_00000004" / "complete.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["optimizer"]
    manifest_file.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"written by torchao's CPUOffloadOptimizer.*run's optimizer is a plain"):
        run_recipe("full", tiny_assets, tmp_path, *settings, "resume_from_checkpoint=True")
