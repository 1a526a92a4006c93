"""Unit tests of the recipes' config check: settings read, and rules taken from the optimizer's
declared capabilities rather than from a list of names (no assets, no model)."""

import inspect
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import OptimizerCapabilities
from torchtune_offload.optim.base_options import accepted_form, check_base_options
from torchtune_offload.recipe import OptimizerKind, check_recipe_config, resolve_optimizer_component

REPO = Path(__file__).resolve().parents[2]
TINY = {"full": "full.yaml", "lora": "lora.yaml", "distributed": "full_distributed.yaml"}


class NoClipSGD(torch.optim.SGD):
    """A plain optimizer that declares it cannot clip, for the tests below."""

    capabilities = OptimizerCapabilities(can_clip=False, reasons={"can_clip": "NoClipSGD's own reason"})


class NoFSDP2SGD(torch.optim.SGD):
    capabilities = OptimizerCapabilities(runs_under_fsdp2=False, reasons={"runs_under_fsdp2": "NoFSDP2SGD says no"})


HERE = __name__


def _cfg(recipe: str, *overrides: str):
    cfg = OmegaConf.load(REPO / "configs" / "tiny" / TINY[recipe])
    return OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))


def _problems(recipe: str, *overrides: str) -> str:
    with pytest.raises(ValueError) as err:
        check_recipe_config(_cfg(recipe, *overrides), recipe=recipe)
    return str(err.value)


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_the_tiny_configs_pass_and_their_settings_are_read(recipe):
    cfg = _cfg(recipe, "gradient_accumulation_steps=3", "clip_grad_norm=2.5")
    s = check_recipe_config(cfg, recipe=recipe)
    assert s.device == torch.device("cpu") and s.dtype == torch.float32
    assert s.batch_size == cfg.batch_size and s.gradient_accumulation_steps == 3 and s.clip_grad_norm == 2.5
    assert s.optimizer.optimizer_class is torch.optim.AdamW and s.optimizer.kind is OptimizerKind.PLAIN
    assert s.optimizer.offload is None and s.optimizer.base_class is torch.optim.AdamW
    assert dict(s.optimizer.base_options) == {k: v for k, v in cfg.optimizer.items() if k != "_component_"}


def test_the_offload_optimizer_is_resolved_with_its_capabilities():
    s = check_recipe_config(
        _cfg("full", "optimizer._component_=torchtune_offload.OffloadOptimizer",
             "optimizer.optimizer_class=torch.optim.AdamW"),
        recipe="full",
    )
    assert s.optimizer.optimizer_class is OffloadOptimizer and s.optimizer.capabilities is OffloadOptimizer.capabilities
    assert s.optimizer.kind is OptimizerKind.OFFLOAD_ENGINE and s.optimizer.base_class is torch.optim.AdamW


def test_a_declared_capability_drives_the_clip_rule():
    message = _problems("full", f"optimizer._component_={HERE}.NoClipSGD", "clip_grad_norm=1.0")
    assert "clip_grad_norm is set" in message and "NoClipSGD's own reason" in message
    # Without clipping the same optimizer passes.
    check_recipe_config(_cfg("full", f"optimizer._component_={HERE}.NoClipSGD", "clip_grad_norm=null"), recipe="full")


def test_clipping_with_torchaos_optimizer_is_refused_by_the_config_check_alone():
    # The rule lives once: the config check refuses it before anything is built.
    message = _problems("full", "optimizer._component_=torchtune_offload.CPUOffloadOptimizer", "clip_grad_norm=1.0")
    assert "clip_grad_norm is set" in message and "cannot clip: torchao" in message


def test_a_declared_capability_drives_the_fsdp2_rule():
    message = _problems("distributed", f"optimizer._component_={HERE}.NoFSDP2SGD")
    assert "not supported under FSDP2" in message and "NoFSDP2SGD says no" in message
    check_recipe_config(_cfg("full", f"optimizer._component_={HERE}.NoFSDP2SGD"), recipe="full")


def test_the_8bit_host_optimizer_is_refused_under_fsdp2_and_accepted_on_one_device():
    message = _problems("distributed", "optimizer._component_=torchtune_offload.AdamW8bit")
    assert "not supported under FSDP2" in message and "blocks of 256 elements" in message
    check_recipe_config(_cfg("full", "optimizer._component_=torchtune_offload.AdamW8bit"), recipe="full")


def test_offload_only_keys_are_checked_for_offload_optimizers_only():
    message = _problems(
        "full", "optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.offload_gradients=maybe",
        "optimizer.optimizer_class=torch.optim.Nope",
    )
    assert "optimizer.offload_gradients='maybe': must be True or False" in message
    assert "optimizer.optimizer_class='torch.optim.Nope' does not resolve" in message


@pytest.mark.parametrize(
    "component, fragment",
    [
        ("torch.optim.AdamWW", "does not resolve"),
        ("torch.optim.lr_scheduler.LambdaLR", "is not a torch.optim.Optimizer subclass"),
        ("torch.nn.functional.relu", "is not a torch.optim.Optimizer subclass"),
        ("torchao.optim.CPUOffloadOptimizer", "Use optimizer._component_=torchtune_offload.CPUOffloadOptimizer"),
        # optimizer=adamw on torchtune's command line sets the _component_.
        ("adamw", "Did you mean 'torch.optim.AdamW' (optimizer=adamw on the command line sets optimizer._component_)?"),
    ],
)
def test_resolve_optimizer_component_refuses(component, fragment):
    with pytest.raises(ValueError) as err:
        resolve_optimizer_component(OmegaConf.create({"_component_": component}))
    assert fragment in str(err.value) and f"optimizer._component_={component}" in str(err.value).replace("'", "")


def test_missing_component():
    with pytest.raises(ValueError, match="optimizer._component_ is missing"):
        resolve_optimizer_component(OmegaConf.create({"lr": 1.0}))


def test_all_problems_in_one_error_each_naming_its_key():
    message = _problems("full", "batch_size=0", "epochs=x", "dtype=fp16", "device=tpu", "log_every_n_steps=0")
    lines = [line for line in message.splitlines() if line.startswith("  - ")]
    for key in ("batch_size=0", "epochs='x'", "dtype='fp16'", "device='tpu'", "log_every_n_steps=0"):
        assert sum(line.startswith(f"  - {key}") for line in lines) == 1, message


@pytest.mark.parametrize("key", ["shuffle", "compile", "resume_from_checkpoint", "optimizer_in_bwd",
                                 "enable_activation_checkpointing", "log_peak_memory_stats"])
def test_a_misspelt_boolean_is_refused_not_taken_as_true(key):
    message = _problems("full", f"{key}=Flase")
    assert f"{key}='Flase': must be True or False." in message


@pytest.mark.parametrize("key", ["fsdp_cpu_offload", "fsdp_reshard_after_forward"])
def test_a_misspelt_fsdp_boolean_is_reported_once(key):
    message = _problems("distributed", f"{key}=maybe")
    assert message.count(f"{key}='maybe': must be True or False.") == 1, message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_gpu_device_without_one_is_a_listed_problem(device):
    message = _problems("full", f"device={device}")
    assert f"device={device}: this machine has no cuda device" in message


# ------------------------------------------------- option values the base optimizer refuses


@pytest.mark.parametrize("overrides, fragments", [
    (["optimizer.lr=fast"], ["optimizer.lr='fast': AdamW refuses it", "'<=' not supported", "Give a number such as 0.001",
                             "e.g. optimizer.lr=0.001"]),
    (["optimizer.betas=0.9"], ["optimizer.betas=0.9: AdamW refuses it", "a list of 2 numbers",
                               "optimizer.betas=[0.9,0.999]"]),
    (["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW",
      "optimizer.lr=-1"], ["optimizer.lr=-1: OffloadOptimizer (base AdamW) refuses it", "Invalid learning rate",
                           "Give a number"]),
    (["optimizer._component_=torch.optim.SGD", "optimizer.momentum=x", "optimizer.nesterov=True"],
     ["optimizer.momentum='x': SGD refuses it", "optimizer.nesterov=True: SGD refuses it",
      "Nesterov momentum requires a momentum"]),
])
@pytest.mark.parametrize("recipe", ["full", "distributed"])
def test_a_refused_option_value_names_the_key_the_value_and_the_accepted_form(recipe, overrides, fragments):
    if recipe == "distributed" and "OffloadOptimizer" in overrides[0]:
        pytest.skip("the offload optimizers are refused under FSDP2 for their own reason")
    message = _problems(recipe, *overrides)
    for fragment in fragments:
        assert fragment in message, message


def test_check_base_options_gives_the_python_api_a_value_error_naming_the_key():
    with pytest.raises(ValueError) as err:
        check_base_options(torch.optim.AdamW, {"lr": "fast", "weight_decay": 0.1})
    message = str(err.value)
    assert message.startswith("optimizer.lr='fast': AdamW refuses it") and "weight_decay" not in message
    check_base_options(torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.9)})  # accepted: no error


def test_accepted_forms_come_from_the_signature():
    sgd = inspect.signature(torch.optim.SGD.__init__).parameters
    adamw = inspect.signature(torch.optim.AdamW.__init__).parameters
    assert accepted_form(adamw["amsgrad"]) == "True or False"
    assert accepted_form(adamw["foreach"]) == "True, False or null"
    assert accepted_form(adamw["eps"]) == "a number such as 1e-08"
    assert accepted_form(sgd["momentum"]) == "a number such as 0"


# ------------------------------------------------- FP8 device weights (optimizer.device_weights)

_ENGINE = ["optimizer._component_=torchtune_offload.OffloadOptimizer", "optimizer.optimizer_class=torch.optim.AdamW"]


def test_fp8_device_weights_pass_the_full_recipes_check():
    s = check_recipe_config(_cfg("full", *_ENGINE, "optimizer.device_weights=fp8"), recipe="full")
    assert s.optimizer.optimizer_class is OffloadOptimizer and s.optimizer.offload.device_weights == "fp8"


@pytest.mark.parametrize("recipe, overrides, fragments", [
    ("full", ["optimizer.device_weights=int8"],
     ["optimizer.device_weights='int8': use fp8", "fp8_per_tensor"]),
    ("full", ["optimizer.device_weights=fp8", "optimizer.update_on=device"],
     ["optimizer.update_on=device with optimizer.device_weights=fp8", "set optimizer.update_on=host"]),
    ("lora", ["optimizer.device_weights=fp8"],
     ["optimizer.device_weights=fp8 with this recipe: the LoRA recipe trains adapters only",
      "~optimizer.device_weights"]),
    ("distributed", ["optimizer.device_weights=fp8"],
     ["optimizer.device_weights=fp8 with this recipe: FSDP2 shards", "~optimizer.device_weights"]),
])
def test_fp8_device_weights_refusals_name_the_key_and_the_fix(recipe, overrides, fragments):
    message = _problems(recipe, *_ENGINE, *overrides)
    for fragment in fragments:
        assert fragment in message, message


def test_device_weights_is_not_an_option_of_a_plain_optimizer():
    assert "optimizer.device_weights: not an option of AdamW" in _problems("full", "optimizer.device_weights=fp8")


@pytest.mark.parametrize("overrides, fragments", [
    (["optimizer.grad_sum_on=gpu", "optimizer.offload_gradients=True"],
     ["optimizer.grad_sum_on='gpu': use 'host'", "'device'"]),
    (["optimizer.grad_sum_on=device"],
     ["optimizer.grad_sum_on=device without optimizer.offload_gradients=True", "~optimizer.grad_sum_on"]),
])
def test_grad_sum_on_refusals_name_the_key_and_the_fix_before_the_model_loads(overrides, fragments):
    with pytest.raises(ValueError) as err:
        check_recipe_config(_cfg("full", *_ENGINE, *overrides), recipe="full")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_sums_on_the_device_pass_the_full_recipes_check():
    cfg = _cfg("full", *_ENGINE, "optimizer.offload_gradients=True", "optimizer.grad_sum_on=device",
               "gradient_accumulation_steps=4")
    assert check_recipe_config(cfg, recipe="full").optimizer.offload_gradients


@pytest.mark.parametrize("overrides, expected", [
    ([], True),
    (["profiler.profile_memory=True"], False),  # torch records no memory events profiling every thread
    (["profiler.all_threads=False"], False),
    (None, True),  # no profiler section
])
def test_the_profiler_records_every_thread_unless_memory_is_profiled(overrides, expected):
    cfg = _cfg("full", *(overrides or []))
    if overrides is None:
        del cfg["profiler"]
    assert check_recipe_config(cfg, recipe="full").profile_all_threads is expected


@pytest.mark.parametrize("overrides, fragment", [
    (["profiler.all_threads=sometimes"], "profiler.all_threads='sometimes': must be True or False"),
    (["profiler.all_threads=True", "profiler.profile_memory=True"], "Set profiler.all_threads=False to profile memory"),
])
def test_profiler_all_threads_refusals_name_the_key_and_the_fix(overrides, fragment):
    assert fragment in _problems("full", *overrides)


@pytest.mark.parametrize("recipe", sorted(TINY))
def test_run_settings_torchtune_checks_late_are_named_by_their_keys_at_once(recipe, monkeypatch):
    message = _problems(recipe, "seed=-1", "cudnn_deterministic_mode=True", "loss.num_output_chunks=0",
                        "checkpointer.model_type=LLAMA33", "tokenizer.max_seq_len=-5")
    for part in ("seed=-1: must be null (a random seed) or an integer from 0 to 4294967295",
                 "cudnn_deterministic_mode=True: must be null", "loss.num_output_chunks=0: must be an integer >= 1",
                 # torchtune cuts every sample to nothing: the run's loss is nan, blamed on the learning rate.
                 "tokenizer.max_seq_len=-5: must be null (no truncation) or an integer >= 1",
                 "checkpointer.model_type='LLAMA33': not a torchtune model type. Did you mean LLAMA3?"):
        assert part in message, (part, message)
    assert "seed='abc'" in _problems(recipe, "seed=abc")
    # torchtune's set_seed adds the rank: the largest seed leaves room for every rank.
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert f"seed={2**32 - 3}: must be null (a random seed) or an integer from 0 to {2**32 - 4}" in _problems(
        recipe, f"seed={2**32 - 3}")
    assert "cudnn_deterministic_mode=1.0" in _problems(recipe, "cudnn_deterministic_mode=1.0")


@pytest.mark.parametrize("seed, mode", [(None, None), (0, "default"), (2**32 - 1, "warn"), (7, "error"), (7, 2)])
def test_seeds_and_debug_modes_set_seed_takes_reach_the_settings(seed, mode):
    from torchtune_offload.recipe.checks.config import _DEBUG_MODES
    assert mode is None or mode in _DEBUG_MODES
    cfg = _cfg("full")
    cfg.seed, cfg.cudnn_deterministic_mode = seed, mode
    s = check_recipe_config(cfg, recipe="full")
    assert (s.seed, s.cudnn_deterministic_mode) == (seed, mode)


def test_a_base_model_in_the_lora_recipe_is_refused_before_any_weight_loads():
    # Before: check_host_memory passed and the recipe failed on cfg.model.lora_rank, or, with the
    # LoRA keys left in, once the weights had loaded.
    message = _problems("lora", "model._component_=torchtune_offload.models.tiny_llama")
    assert ("model._component_=torchtune_offload.models.tiny_llama builds no LoRA adapters, and "
            "lora_finetune_single_device trains adapters only") in message
    assert "run full_finetune_single_device" in message


@pytest.mark.parametrize("recipe", ["full", "distributed"])
def test_a_lora_model_in_a_full_recipe_is_refused_before_any_weight_loads(recipe):
    # Before: the base checkpoint's load_state_dict failed on the missing adapter weights.
    message = _problems(recipe, "model._component_=torchtune_offload.models.lora_tiny_llama",
                        "model.lora_attn_modules=[q_proj]")
    assert "model._component_=torchtune_offload.models.lora_tiny_llama builds LoRA adapters" in message
    assert "or run lora_finetune_single_device" in message


def test_the_lora_recipe_requires_the_lora_keys_it_records():
    message = _problems("lora", "model.lora_rank=null", "model.lora_alpha=null")
    assert "model.lora_rank: required by lora_finetune_single_device" in message
    assert "model.lora_alpha: required by lora_finetune_single_device" in message


def test_a_config_written_for_another_recipe_is_named_as_such():
    full_in_lora = check_problems_for_config("full", recipe="lora")
    assert ("optimizer_in_bwd: unknown config key for lora_finetune_single_device. It is a key of "
            "full_finetune_distributed and full_finetune_single_device: remove it (~optimizer_in_bwd), or run the "
            "config with one of those recipes.") in full_in_lora
    assert "builds no LoRA adapters" in full_in_lora
    lora_in_full = check_problems_for_config("lora", recipe="full")
    assert ("save_adapter_weights_only: unknown config key for full_finetune_single_device. It is a key of "
            "lora_finetune_single_device: remove it (~save_adapter_weights_only), or run the config with that "
            "recipe.") in lora_in_full
    assert "builds LoRA adapters" in lora_in_full
    # A typo still gets the closest key; a key like no other says both ways to remove it (a
    # key=value override cannot be deleted with ~key, which only deletes keys of the YAML).
    assert "Did you mean 'batch_size'?" in _problems("full", "batch_sise=2")
    assert ("zzzz: unknown config key for full_finetune_single_device. Remove it: drop a zzzz=... override, or "
            "~zzzz deletes it from the YAML.") in _problems("full", "zzzz=1")


def check_problems_for_config(config: str, *, recipe: str) -> str:
    with pytest.raises(ValueError) as err:
        check_recipe_config(_cfg(config), recipe=recipe)
    return str(err.value)


@pytest.mark.parametrize("overrides, fragment", [
    # Hydra's '+' adds a key; torchtune's command line has no such syntax (and ~+foo meant nothing).
    (["+batch_size=4"], "+batch_size: unknown config key for full_finetune_single_device. torchtune's command "
                        "line has no '+' syntax (key=value adds a key too): write it without the '+' (batch_size=4)."),
    (["+optimizer.lr=1"], "write it without the '+' (optimizer.lr=1)."),  # not optimizer=..., which sets _component_
    (["+foo=1"], "+foo: unknown config key for full_finetune_single_device. torchtune's command line has no '+' "
                 "syntax (key=value adds a key too): drop the +foo=... override."),
    # A misspelt _component_ is an option like any other, with the closest name.
    (["optimizer._compnent_=torchtune_offload.OffloadOptimizer"],
     "optimizer._compnent_: not an option of AdamW. Did you mean '_component_'?"),
    (["lr_scheduler._componnt_=x"], "Did you mean 'lr_scheduler._component_'?"),
])
def test_a_plus_key_and_a_misspelt_component_key_say_what_to_write(overrides, fragment):
    message = _problems("full", *overrides)
    assert fragment in message and "~+" not in message, message
