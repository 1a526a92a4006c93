"""The recipes' host-RAM pre-flight: sized from meta shapes before loading, checked against what runs hold."""

import re
import time

import pytest
import torch

from tests import zygote
from tests.recipe.test_recipes import FULL_OFFLOAD, REPO_ROOT, _config, _load_recipe_class, run_recipe
from tests.recipe_harness import TUNE, working_tree_env
from torchtune_offload.recipe.checks import fit as host_preflight

GIB = 1024**3
OFFLOAD_ACCUM = [*FULL_OFFLOAD, "optimizer.offload_gradients=True", "gradient_accumulation_steps=2",
                 "max_steps_per_epoch=2", "batch_size=4"]


def _state_bytes(optimizer):
    states = optimizer.state.values()
    return sum(t.numel() * t.element_size() for st in states for t in st.values() if isinstance(t, torch.Tensor))


def test_plain_adamw_on_cpu_is_sized_exactly(tiny_assets, tmp_path):
    run = run_recipe("full", tiny_assets, tmp_path, "max_steps_per_epoch=2", "batch_size=4")
    need = run.recipe.host_memory
    model = run.recipe._model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    train = need.phases["training"]
    assert train["model"] == weights
    assert train["gradients"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert train["optimizer state"] == _state_bytes(run.recipe._optimizer.optimizer)
    ckpt = tiny_assets / "model" / "model.safetensors"
    assert need.phases["loading the checkpoint"] == {"checkpoint files": ckpt.stat().st_size, "model": weights}
    assert need.fits and need.peak == sum(train.values())


def test_offload_optimizer_plan_matches_its_report(tiny_assets, tmp_path):
    run = run_recipe("full", tiny_assets, tmp_path, *OFFLOAD_ACCUM)
    train = run.recipe.host_memory.phases["training"]
    report = run.recipe._optimizer.memory_report()
    planned = train["parameter copies"] + train["gradient buffers"] + train["optimizer state"]
    assert planned == report.host_bytes - run.recipe._optimizer.optimizer._staging.nbytes
    assert train["staging ring"] >= run.recipe._optimizer.optimizer._staging.nbytes
    assert "gradients" not in train  # offload_gradients: the model keeps none between micro-batches


def test_lora_counts_the_adapters_state_only(tiny_assets, tmp_path):
    run = run_recipe("lora", tiny_assets, tmp_path, "max_steps_per_epoch=2", "batch_size=4")
    train = run.recipe.host_memory.phases["training"]
    adapters = [p for p in run.recipe._model.parameters() if p.requires_grad]
    assert train["gradients"] == sum(p.numel() * p.element_size() for p in adapters)
    assert train["optimizer state"] == _state_bytes(run.recipe._optimizer.optimizer)


def test_a_run_that_does_not_fit_fails_in_init_with_figures(tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(host_preflight, "available_host_memory", lambda: 1024)
    cfg = _config("full", tiny_assets, tmp_path, [*FULL_OFFLOAD])
    with pytest.raises(ValueError) as err:
        _load_recipe_class("full")(cfg)
    message = str(err.value)
    assert message.startswith("host_memory_check: the run does not fit")
    for part in ("loading the checkpoint:", "training:", "optimizer state", "0.00 GiB are available",
                 "optimizer.optimizer_class=torchtune_offload.AdamW8bit", "host_memory_check=False"):
        assert part in message, message
    # The 8-bit suggestion is sized (the meta step of torchtune_offload.AdamW8bit), not "cannot be sized".
    sized = re.search(r"optimizer_class=torchtune_offload\.AdamW8bit \(8-bit states, fused host step\): "
                      r"([0-9.]+) GiB, does not fit either", message)
    assert sized, message
    # The device update is suggested and sized too: states alone on the host.
    assert re.search(r"optimizer\.update_on=device optimizer\.offload_gradients=False \(states alone on the host, "
                     r"updates on the device, if the weights and gradients fit it\): ([0-9.]+) GiB", message), message
    assert not (tmp_path / "logs").exists()  # nothing was set up


@pytest.mark.parametrize("option, removed", [
    ("optimizer.grad_sum_on=device", "~optimizer.grad_sum_on"),
    ("optimizer.device_weights=fp8", "~optimizer.device_weights"),
    ("optimizer.grad_sum_dtype=fp32", "~optimizer.grad_sum_dtype"),
    ("optimizer.overlap=True optimizer.overlap_timeout_s=60", "~optimizer.overlap_timeout_s"),
    ("dtype=bf16 optimizer.master_dtype=fp32", "~optimizer.master_dtype"),
])
def test_the_device_update_suggestion_drops_what_it_refuses(tiny_assets, tmp_path, monkeypatch, option, removed):
    """update_on=device refuses grad_sum_on=device and FP8 device weights: the suggestion removes
    them, so it is sized (not "cannot be sized") and runs as printed."""
    monkeypatch.setattr(host_preflight, "available_host_memory", lambda: 1024)
    cfg = _config("full", tiny_assets, tmp_path, [*OFFLOAD_ACCUM, *option.split()])
    with pytest.raises(ValueError) as err:
        _load_recipe_class("full")(cfg)
    message = str(err.value)
    assert re.search(rf"optimizer\.update_on=device optimizer\.offload_gradients=False {re.escape(removed)} "
                     r"\(states alone on the host, [^\n]*\): ([0-9.]+) GiB", message), message
    assert "cannot be sized" not in message, message


def test_device_update_plan_is_its_report(tiny_assets, tmp_path):
    run = run_recipe("full", tiny_assets, tmp_path, *FULL_OFFLOAD, "optimizer.update_on=device",
                     "max_steps_per_epoch=2", "batch_size=4")
    train = run.recipe.host_memory.phases["training"]
    report = run.recipe._optimizer.memory_report()
    # The streamed states, exactly; no parameter copies or gradient buffers on the host.
    assert train["optimizer state"] == report.host_bytes > 0
    assert not {"parameter copies", "gradient buffers"} & train.keys()


def test_the_check_can_be_turned_off(tiny_assets, tmp_path, monkeypatch):
    monkeypatch.setattr(host_preflight, "available_host_memory", lambda: 1024)
    cfg = _config("full", tiny_assets, tmp_path, ["host_memory_check=False"])
    assert _load_recipe_class("full")(cfg).host_memory is None


def test_the_key_is_a_strict_boolean(tiny_assets, tmp_path):
    cfg = _config("full", tiny_assets, tmp_path, ["host_memory_check=1"])
    with pytest.raises(ValueError, match="host_memory_check=1: must be True or False"):
        _load_recipe_class("full")(cfg)


@pytest.mark.skipif(host_preflight.available_host_memory() > 70 * GIB, reason="this machine could fit 8B on the CPU")
def test_8b_on_the_cpu_fails_within_seconds_from_the_command_line():
    start = time.perf_counter()
    out = zygote.run(
        [*TUNE, "run", "recipes/full_finetune_single_device.py", "--config",
         "configs/llama3_1/8B_full_offload_engine.yaml", "device=cpu", "output_dir=/nonexistent/never",
         "checkpointer.checkpoint_dir=/nonexistent/weights"],
        cwd=REPO_ROOT, env=working_tree_env(), capture_output=True, text=True, timeout=120,
    )
    seconds = time.perf_counter() - start
    assert out.returncode != 0
    assert "host_memory_check: the run does not fit" in out.stderr, out.stderr[-3000:]
    assert "training: " in out.stderr and "GiB are available" in out.stderr
    # A checkpoint not downloaded yet: the same error names it, after the memory.
    assert out.stderr.index("the run does not fit") < out.stderr.index("Files the config names cannot be used:")
    assert "checkpointer.checkpoint_dir=/nonexistent/weights: no such directory" in out.stderr
    assert seconds < 60


# ---------------------------------------------------------------- precision policy in the recipe


def test_fp32_masters_train_a_bf16_model_in_the_recipe(tiny_assets, tmp_path):
    run = run_recipe("full", tiny_assets, tmp_path, *FULL_OFFLOAD, "dtype=bf16", "optimizer.master_dtype=fp32",
                     "max_steps_per_epoch=30", "batch_size=8")
    opt = run.recipe._optimizer.optimizer
    assert all(s.step_param.dtype == torch.float32 and s.param.dtype == torch.bfloat16 for s in opt._slots)
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 1.0, run.losses
    # The pre-flight sized the fp32 masters: 4-byte copies of the offloaded weights.
    offloaded = sum(s.param.numel() for s in opt._slots if s.offloaded)
    assert run.recipe.host_memory.phases["training"]["parameter copies"] == 4 * offloaded


@pytest.mark.parametrize("overrides, expected", [
    (["optimizer.master_dtype=fp32"], "optimizer.master_dtype=fp32 with torch.optim.AdamW: a plain optimizer"),
    ([*FULL_OFFLOAD, "optimizer.grad_sum_dtype=fp16"], "optimizer.grad_sum_dtype='fp16': use fp32"),
])
def test_precision_keys_are_checked_up_front(tiny_assets, tmp_path, overrides, expected):
    cfg = _config("full", tiny_assets, tmp_path, overrides)
    with pytest.raises(ValueError, match=expected):
        _load_recipe_class("full")(cfg)
