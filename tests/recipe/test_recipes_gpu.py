"""The single-device recipe on a real accelerator (marker ``gpu``; skipped on CPU-only machines).

The CPU tests prove the math; these prove the CUDA path: pinned host buffers and side-stream copies
inside a real training loop, torchao's and bitsandbytes' optimizers, and the NVML memory figures.
"""

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import REPO_ROOT as REPO
from tests.recipe.test_recipes import FULL_EQUIV, FULL_OFFLOAD, LEARN, run_recipe
from torchtune_offload.recipe import (
    OptimizerKind,
    OwnGradientsOptimizer,
    check_lora_model_fits_device,
    check_recipe_config,
    check_weights_fit_device,
)
from torchtune_offload.recipe.reports.memory import GIB

pytestmark = pytest.mark.gpu
ON_GPU = ["device=cuda", "dtype=fp32"]
# Host fused AdamW against device AdamW: the same math in another order of operations.
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gpu_runs(tiny_assets, tmp_path_factory):
    cache = {}

    def get(*overrides):
        if overrides not in cache:
            cache[overrides] = run_recipe("full", tiny_assets, tmp_path_factory.mktemp("gpu_run"), *ON_GPU, *overrides)
        return cache[overrides]

    return get


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_offload_recipe_matches_plain_adamw_on_gpu(gpu_runs, offload_gradients):
    plain = gpu_runs(*FULL_EQUIV)
    off = gpu_runs(*FULL_EQUIV, *FULL_OFFLOAD, f"optimizer.offload_gradients={offload_gradients}")
    torch.testing.assert_close(torch.tensor(off.losses), torch.tensor(plain.losses), **TOL)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in off.log]),
                               torch.tensor([r["grad_norm"] for r in plain.log]), **TOL)
    for name, p in plain.params.items():
        torch.testing.assert_close(off.params[name], p, msg=lambda m: f"{name}: {m}", **TOL)
    row = off.log[-1]
    assert row["optimizer_pinned"] > 0  # host buffers are pinned on a CUDA machine
    assert row["peak_memory_alloc"] > 0
    # The caching allocator's stalls since the previous log line (recipe/reports/memory.py, ALLOCATOR_EVENTS).
    assert all(row[k] >= 0 for k in ("alloc_retries", "device_allocs", "device_frees", "sync_all_streams"))
    assert off.recipe._optimizer.memory_report().num_offloaded > 0


def test_nvml_peak_is_logged_on_gpu(gpu_runs):
    pytest.importorskip("pynvml")
    row = gpu_runs(*FULL_EQUIV).log[-1]
    # NVML sees the whole device: at least what this process's allocator reserved.
    assert row["nvml_device_used_peak"] >= row["peak_memory_reserved"] > 0


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_torchao_in_the_recipe_matches_plain_adamw_on_gpu(gpu_runs, offload_gradients):
    # torchao's optimizer neither clips nor sees the recipe's scaling; without both it is exact.
    settings = ["max_steps_per_epoch=5", "batch_size=4", "gradient_accumulation_steps=1", "clip_grad_norm=null"]
    plain = gpu_runs(*settings)
    ao = gpu_runs(*settings, "optimizer._component_=torchtune_offload.CPUOffloadOptimizer",
                  "optimizer.optimizer_class=torch.optim.AdamW", "optimizer.minimal_size=1024",
                  f"optimizer.offload_gradients={offload_gradients}")
    run = ao.recipe._optimizer
    assert type(run) is OwnGradientsOptimizer and run.kind is OptimizerKind.TORCHAO_OFFLOAD
    torch.testing.assert_close(torch.tensor(ao.losses), torch.tensor(plain.losses), **TOL)
    # The norm of the gradients torchao steps on, also those offload_gradients freed on the device.
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in ao.log]),
                               torch.tensor([r["grad_norm"] for r in plain.log]), **TOL)
    for name, p in plain.params.items():
        torch.testing.assert_close(ao.params[name], p, msg=lambda m: f"{name}: {m}", **TOL)
    assert ao.log[-1]["optimizer_pinned"] > 0 and run.memory_report().num_offloaded > 0


@pytest.mark.parametrize("component", ["bitsandbytes.optim.PagedAdamW", "bitsandbytes.optim.PagedAdamW8bit"])
def test_bitsandbytes_paged_optimizers_learn_on_gpu(gpu_runs, component):
    pytest.importorskip("bitsandbytes")
    run = gpu_runs(*LEARN, f"optimizer._component_={component}")
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 1.0, run.losses


def test_weights_larger_than_the_free_device_memory_are_refused_on_gpu():
    """The load check against the real device's free memory: a model larger than the whole card
    (meta tensors: nothing allocated) is refused by size, one that fits passes."""
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    too_big = {"w": torch.empty(total // 2 + 1, dtype=torch.bfloat16, device="meta")}
    with pytest.raises(ValueError, match=f"device={device}: the model's weights are"):
        check_weights_fit_device(too_big, device=device, dtype=torch.bfloat16)
    check_weights_fit_device({"w": torch.empty(2**20, device="meta")}, device=device, dtype=torch.bfloat16)


def test_a_lora_model_larger_than_the_free_device_memory_is_refused_on_gpu():
    """The LoRA recipe's load check against the real device's free memory: a tiny LoRA model widened
    past the whole card (built on the meta device: nothing allocated) is refused by size, the tiny
    one passes."""
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "configs" / "tiny" / "lora.yaml"),
                          OmegaConf.from_dotlist([f"device=cuda:{device.index}", "dtype=bf16"]))
    settings = check_recipe_config(cfg, recipe="lora")
    check_lora_model_fits_device(cfg.model, settings)
    # Each layer's four 32768-wide attention projections: 4 x 2 GiB in bf16.
    layers = total // (8 * GIB) + 1
    wide = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"model.num_layers={layers}", "model.embed_dim=32768",
                                                         "model.num_kv_heads=4"]))
    with pytest.raises(ValueError, match=f"device={device}: the model is .* GiB \\(in torch.bfloat16"):
        check_lora_model_fits_device(wide.model, check_recipe_config(wide, recipe="lora"))
