"""Reading and checking a recipe's config before anything large is allocated.

torchtune's recipes read keys with ``cfg.get(key, default)``, so a typo silently falls back to the
default. Here every top-level key must be known to the recipe, every value is checked, and every
problem found is reported in one ``ValueError`` that names the key and the fix. The rules are
grouped by concern: keys, numbers, checkpoints, the optimizer (``optimizer_rules``), the device,
activations, data, and each recipe's own (LoRA modules, FSDP2).
"""

import difflib
import inspect
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training, utils
from torchtune.training import ModelType
from torchtune.config._utils import _get_component_from_path
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_offload.distributed.policies import policy_problems
from torchtune_offload.distributed.sharded_offload import sharded_option_problems
from torchtune_offload.recipe.checks.component_options import component_option_problems, model_option_problems, nulled
from torchtune_offload.recipe.checks.config_keys import RECIPE_KEYS
from torchtune_offload.recipe.checks.optimizer_rules import (
    add_optimizer_problems,
    component_capabilities,
    configured_device_weights,
    is_int,
)
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, OptimizerKind, describe_optimizer
from torchtune_offload.recipe.shipped import RECIPE_KINDS

#: The name ``tune run`` and ``tune-offload run`` know each recipe by.
_RECIPE_NAMES = {kind: name for name, kind in RECIPE_KINDS.items()}
#: The model options the LoRA recipe reads itself (it records them with the adapter it saves).
_LORA_MODEL_KEYS = ("lora_attn_modules", "lora_rank", "lora_alpha")
#: What ``training.set_seed`` takes as its debug mode (see ``torch.set_deterministic_debug_mode``).
_DEBUG_MODES = ("default", "warn", "error", 0, 1, 2)
_REQUIRED = ("model", "tokenizer", "dataset", "checkpointer", "optimizer", "loss", "metric_logger",
             "output_dir", "batch_size", "epochs", "device", "dtype")
_DEFAULT_COLLATE = "torchtune.data.padded_collate_sft"


@dataclass(frozen=True)
class RecipeSettings:
    """The validated scalar settings of a recipe config (components stay in the config)."""

    device: torch.device
    dtype: torch.dtype
    batch_size: int
    epochs: int
    max_steps_per_epoch: Optional[int]
    gradient_accumulation_steps: int
    clip_grad_norm: Optional[float]
    #: The optimizer the config chooses (``optimizer`` and ``optimizer_in_bwd``).
    optimizer: ChosenOptimizer
    compile: bool
    enable_activation_checkpointing: bool
    enable_activation_offloading: bool
    log_every_n_steps: int
    log_peak_memory_stats: bool
    resume_from_checkpoint: bool
    seed: Optional[int]
    shuffle: bool
    collate_fn: str
    #: torchtune's debug mode for nondeterministic ops: None, "default", "warn", "error", 0, 1 or 2.
    cudnn_deterministic_mode: Optional[typing.Union[str, int]]
    save_adapter_weights_only: bool
    fsdp_cpu_offload: bool
    fsdp_reshard_after_forward: bool
    host_memory_check: bool
    save_every_n_steps: Optional[int] = None
    keep_last_n_checkpoints: int = 2
    #: A profiler (``profiler.enabled``) records every thread, the engine's host threads too.
    profile_all_threads: bool = True


class ConfigError(ValueError):
    """A run the recipe refuses before it trains, for its config or for the files and the machine
    the config names; the message names each key and the fix. ``tune-offload run`` prints it
    without a traceback (a ``ValueError``, so callers that catch those still do)."""


class _Reader:
    """Reads top-level keys with their defaults, noting each bad value in ``problems``."""

    def __init__(self, cfg: DictConfig, problems: List[str]) -> None:
        self.cfg = cfg
        self.problems = problems

    def get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(key, default)
        return default if value is None and default is not None else value

    def flag(self, key: str, default: bool) -> bool:
        # bool("Flase") is True: a misspelt word must not switch a feature on.
        value = self.get(key, default)
        if not isinstance(value, bool):
            self.problems.append(f"{key}={value!r}: must be True or False.")
            return default
        return value

    def count(self, key: str, default: Optional[int], *, low: int, fix: str = "") -> Optional[int]:
        value = self.get(key, default)
        if not is_int(value, low=low):
            self.problems.append(f"{key}={value!r}: must be an integer >= {low}{fix}.")
        return value


def check_recipe_config(cfg: DictConfig, *, recipe: str, device_present: bool = True) -> RecipeSettings:
    """Validates ``cfg`` for ``recipe`` ("full", "lora" or "distributed") and reads its settings.

    Args:
        cfg: the recipe config.
        recipe: which recipe reads it.
        device_present: require the configured device on this machine (a run does); the memory
            planner, which plans a GPU run on any machine, passes False.

    Raises:
        ConfigError: listing every problem found, each naming its key and the fix.
    """
    problems = config_shape_problems(cfg, recipe=recipe)
    if problems:
        raise ConfigError(_format(problems))
    read = _Reader(cfg, problems)
    numbers = _numbers(read)
    checkpoints = _checkpoint_settings(read)
    in_bwd = read.flag("optimizer_in_bwd", False)
    optimizer = _optimizer_settings(cfg, problems, in_bwd=in_bwd, clip=numbers["clip_grad_norm"],
                                    accum=numbers["gradient_accumulation_steps"], sharded=recipe == "distributed")
    device_name, dtype_name = _device_problems(cfg, problems, device_present=device_present)
    activations = _activation_settings(read, is_cuda=device_name.startswith("cuda"))
    collate_fn = _collate_fn(read)
    seed, debug_mode = _seed_settings(read)
    problems.extend(_component_value_problems(cfg))
    profile_all_threads = _profile_all_threads(cfg, problems)
    flags = {key: read.flag(key, default) for key, default in (
        ("compile", False), ("log_peak_memory_stats", True), ("resume_from_checkpoint", False),
        ("shuffle", True), ("save_adapter_weights_only", False), ("host_memory_check", True),
        ("overwrite_checkpoints", False),
        # Keys of the distributed recipe only; the others reject them as unknown above.
        ("fsdp_cpu_offload", False), ("fsdp_reshard_after_forward", True),
    )}
    if recipe == "lora":
        problems.extend(_lora_problems(read, optimizer))
    if recipe == "distributed":
        problems.extend(_distributed_problems(read, optimizer))
    if problems:
        raise ConfigError(_format(problems))

    device, dtype = _device_and_dtype(device_name, dtype_name, device_present=device_present)
    return RecipeSettings(
        device=device, dtype=dtype, **numbers, **checkpoints, optimizer=optimizer, **activations,
        compile=flags["compile"],
        log_peak_memory_stats=flags["log_peak_memory_stats"],
        resume_from_checkpoint=flags["resume_from_checkpoint"],
        seed=seed,
        shuffle=flags["shuffle"],
        collate_fn=collate_fn,
        cudnn_deterministic_mode=debug_mode,
        save_adapter_weights_only=flags["save_adapter_weights_only"],
        fsdp_cpu_offload=flags["fsdp_cpu_offload"],
        fsdp_reshard_after_forward=flags["fsdp_reshard_after_forward"],
        host_memory_check=flags["host_memory_check"],
        profile_all_threads=profile_all_threads,
    )


def _device_and_dtype(device_name: str, dtype_name: str, *, device_present: bool) -> Tuple[torch.device, torch.dtype]:
    """The checked device and dtype: torchtune's lookups where the device is on this machine, else
    (a plan of a GPU run on any machine) their names taken as they are."""
    if device_present:
        device = utils.get_device(device=device_name)
        return device, training.get_dtype(dtype_name, device=device)
    return torch.device(device_name), {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]


def config_shape_problems(cfg: DictConfig, *, recipe: str) -> List[str]:
    """What :func:`check_recipe_config` checks first, and what no optimizer setting changes: the
    top-level keys, each component's options and the model builder (the planner stops on these
    before it plans any variant).

    Args:
        cfg: the recipe config.
        recipe: which recipe reads it ("full", "lora" or "distributed").

    Returns:
        One line per problem, naming the key and the fix; empty when there is none.
    """
    problems = _key_problems(cfg, recipe=recipe) + component_option_problems(cfg)
    # A LoRA key the recipe requires is named once, by the first; the builder's own rules follow.
    return problems + (_model_kind_problems(cfg, recipe=recipe) or model_option_problems(cfg))


def _leaf_overrides(path: str, value: Any) -> List[str]:
    """``key=value`` for each leaf under ``path`` (``+optimizer.lr=1`` arrives as ``{'+optimizer': {'lr': 1}}``)."""
    if isinstance(value, DictConfig):
        return [o for k, v in value.items() for o in _leaf_overrides(f"{path}.{k}", v)]
    return [f"{path}={value}"]


def _key_problems(cfg: DictConfig, *, recipe: str) -> List[str]:
    """Unknown keys (with the closest known one) and missing required ones."""
    known = RECIPE_KEYS[recipe]
    problems = []
    for key in cfg.keys():
        if key not in known:
            # A key of another recipe's configs: most likely the config was written for that recipe.
            others = [_RECIPE_NAMES[r] for r in sorted(RECIPE_KEYS) if key in RECIPE_KEYS[r]]
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            if str(key).startswith("+"):
                # Hydra's syntax for a new key; torchtune's command line takes plain key=value for any key.
                bare = str(key)[1:]
                fix = (f"write it without the '+' ({', '.join(_leaf_overrides(bare, cfg[key]))})" if bare in known
                       else f"drop the {key}=... override")
                hint = f" torchtune's command line has no '+' syntax (key=value adds a key too): {fix}."
            elif others:
                which = "that recipe" if len(others) == 1 else "one of those recipes"
                hint = f" It is a key of {' and '.join(others)}: remove it (~{key}), or run the config with {which}."
            else:
                # The key may come from the YAML or from a key=value override, which ~key cannot delete.
                hint = (f" Did you mean '{close[0]}'?" if close else
                        f" Remove it: drop a {key}=... override, or ~{key} deletes it from the YAML.")
            problems.append(f"{key}: unknown config key for {_RECIPE_NAMES[recipe]}.{hint}")
    for key in _REQUIRED:
        node = cfg.get(key)
        if node is None:
            problems.append(f"{key}: required; set it in the config or with {key}=... on the command line.")
        elif isinstance(node, DictConfig) and nulled(node):
            # torchtune reads key=null on the command line as key._component_=null.
            problems.append(f"{key}._component_ is null ({key}=null on the command line sets it): {key} is required; "
                            "give the dotted path of its component.")
    return problems


def _model_kind_problems(cfg: DictConfig, *, recipe: str) -> List[str]:
    """A model builder of the wrong kind for the recipe: a LoRA builder (one taking
    ``lora_attn_modules``) in a full recipe, whose base checkpoint has no adapter weights, or a base
    builder in the LoRA recipe, which trains adapters only. Both fail only after the weights load."""
    model = cfg.get("model")
    path = model.get("_component_") if isinstance(model, DictConfig) else None
    if not path:
        return []
    try:
        builds_lora = "lora_attn_modules" in inspect.signature(_get_component_from_path(str(path))).parameters
    except Exception:  # an unimportable builder is named by model_option_problems
        return []
    if recipe != "lora" and builds_lora:
        return [f"model._component_={path} builds LoRA adapters, which {_RECIPE_NAMES[recipe]} does not train: "
                "the full recipes train every weight of a base model. Use the base model's builder (the same "
                f"name without lora_ or qlora_), or run {_RECIPE_NAMES['lora']}."]
    if recipe == "lora" and not builds_lora:
        return [f"model._component_={path} builds no LoRA adapters, and {_RECIPE_NAMES['lora']} trains adapters "
                "only. Use a LoRA builder (for example torchtune.models.llama3_2.lora_llama3_2_1b), or run "
                f"{_RECIPE_NAMES['full']}."]
    if recipe == "lora":
        return [f"model.{key}: required by {_RECIPE_NAMES['lora']}, which records it with the adapter it saves. "
                f"Set it in the config or with model.{key}=... on the command line."
                for key in _LORA_MODEL_KEYS if model.get(key) is None]
    return []


def _component_value_problems(cfg: DictConfig) -> List[str]:
    """Values of component options that torchtune checks only when it uses them: the loss's chunk
    count (at the first step), the tokenizer's truncation length (a nan loss) and the checkpointer's
    model type (a bare ``KeyError``)."""
    problems = []
    loss = cfg.get("loss")
    chunks = loss.get("num_output_chunks") if isinstance(loss, DictConfig) else None
    if chunks is not None and not is_int(chunks, low=1):
        problems.append(f"loss.num_output_chunks={chunks!r}: must be an integer >= 1 (the output projection and "
                        "its loss run in that many pieces; torchtune's configs use 8).")
    tokenizer = cfg.get("tokenizer")
    seq_len = tokenizer.get("max_seq_len") if isinstance(tokenizer, DictConfig) else None
    if seq_len is not None and not is_int(seq_len, low=1):
        # torchtune truncates to it: at 0 or below every sample is cut to nothing, and the loss is nan.
        problems.append(f"tokenizer.max_seq_len={seq_len!r}: must be null (no truncation) or an integer >= 1, the "
                        "tokens a sample is cut to (the shipped configs use 2048).")
    checkpointer = cfg.get("checkpointer")
    model_type = checkpointer.get("model_type") if isinstance(checkpointer, DictConfig) else None
    if model_type is not None and str(model_type) not in ModelType.__members__:
        names = list(ModelType.__members__)
        close = difflib.get_close_matches(str(model_type), names, n=1)
        hint = f"Did you mean {close[0]}? " if close else ""
        problems.append(f"checkpointer.model_type={model_type!r}: not a torchtune model type. {hint}"
                        f"It is one of {', '.join(names)}.")
    return problems


def _seed_settings(read: _Reader) -> typing.Tuple[Optional[int], Any]:
    """The seed (null: a random one) and the debug mode for nondeterministic ops, which
    ``training.set_seed`` takes."""
    seed = read.get("seed", None)
    # torchtune adds the rank to the seed and needs the sum to fit an unsigned 32-bit integer
    # (torchrun sets WORLD_SIZE before the recipe reads its config).
    ranks = os.environ.get("WORLD_SIZE", "1")
    highest = 2**32 - (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1)
    if seed is not None and not (is_int(seed, low=0) and seed <= highest):
        read.problems.append(f"seed={seed!r}: must be null (a random seed) or an integer from 0 to {highest}.")
    mode = read.get("cudnn_deterministic_mode", None)
    # True would pass as 1 ("warn"): a flag must not pick a level silently.
    if mode is not None and not any(type(mode) is type(m) and mode == m for m in _DEBUG_MODES):
        read.problems.append(f"cudnn_deterministic_mode={mode!r}: must be null (leave PyTorch's settings), "
                             "'default' (or 0), 'warn' (or 1) or 'error' (or 2).")
    return seed, mode


def _numbers(read: _Reader) -> Dict[str, Any]:
    """Batch and window sizes, epochs, logging and clipping."""
    batch_size = read.count("batch_size", None, low=1)
    epochs = read.count("epochs", None, low=1)
    accum = read.count("gradient_accumulation_steps", 1, low=1)
    log_every = read.count("log_every_n_steps", 1, low=1)
    max_steps = read.get("max_steps_per_epoch", None)
    if max_steps is not None and not is_int(max_steps, low=1):
        read.problems.append(f"max_steps_per_epoch={max_steps!r}: must be null or an integer >= 1.")
    clip = read.get("clip_grad_norm", None)
    if clip is not None:
        try:
            clip = float(clip)
            if not clip > 0:
                raise ValueError
        except (TypeError, ValueError):
            read.problems.append(f"clip_grad_norm={clip!r}: must be null or a positive number ('inf' logs the norm only).")
            clip = None
    return {"batch_size": batch_size, "epochs": epochs, "gradient_accumulation_steps": accum,
            "log_every_n_steps": log_every, "max_steps_per_epoch": max_steps, "clip_grad_norm": clip}


def _checkpoint_settings(read: _Reader) -> Dict[str, Any]:
    """How often step checkpoints are written and how many are kept."""
    save_every = read.get("save_every_n_steps", None)
    if save_every is not None and not is_int(save_every, low=1):
        read.problems.append(f"save_every_n_steps={save_every!r}: must be null (checkpoints at epoch ends only) or an "
                             "integer >= 1.")
    keep_last = read.count("keep_last_n_checkpoints", 2, low=1,
                           fix=" (the newest checkpoints kept in output_dir/checkpoints; older ones are removed)")
    return {"save_every_n_steps": save_every, "keep_last_n_checkpoints": keep_last}


def _optimizer_settings(cfg: DictConfig, problems: List[str], *, in_bwd: bool, clip: Optional[float],
                        accum: Any, sharded: bool) -> Optional[ChosenOptimizer]:
    """The chosen optimizer, described once every rule about it passed (``recipe/checks/optimizer_rules.py``);
    None where one did not (its problems are added to ``problems``)."""
    before = len(problems)
    add_optimizer_problems(cfg, problems, in_bwd=in_bwd, clip=clip, accum=accum)
    if len(problems) > before:
        return None
    try:
        return describe_optimizer(cfg.optimizer, in_backward=in_bwd, sharded=sharded)
    except ValueError as err:  # the rules above check what this reads: a safety net
        problems.append(str(err))
        return None


def _device_problems(cfg: DictConfig, problems: List[str], *, device_present: bool) -> typing.Tuple[str, str]:
    """The device (present on this machine, unless only planning) and the dtype."""
    device_name = str(cfg.device)
    requested = device_name.split(":")[0]
    if requested not in ("cpu", "cuda", "xpu", "npu", "mps"):
        problems.append(f"device={device_name!r}: use cpu, cuda or xpu.")
    if requested in ("cuda", "xpu", "npu", "mps") and device_present:
        try:
            available = utils.get_device(device=device_name).type == requested
        except (AssertionError, RuntimeError):  # e.g. cuda:0 on a torch built without CUDA
            available = False
        if not available:
            # torchtune's get_device falls back to the CPU without a word; a run meant for a GPU must not.
            problems.append(f"device={device_name}: this machine has no {requested} device that PyTorch can use. "
                            "Set device=cpu to train on the CPU, or check the driver and the torch build.")
    dtype_name = str(cfg.dtype)
    if dtype_name not in ("fp32", "bf16"):
        problems.append(f"dtype={dtype_name!r}: use bf16 or fp32 (fp16 full training is not supported).")
    return device_name, dtype_name


def _activation_settings(read: _Reader, *, is_cuda: bool) -> Dict[str, bool]:
    """Activation checkpointing, and offloading, which needs it and a CUDA device."""
    ac = read.flag("enable_activation_checkpointing", False)
    act_offload = read.flag("enable_activation_offloading", False)
    if act_offload and not is_cuda:
        read.problems.append("enable_activation_offloading=True needs device=cuda. Set it to False.")
    if act_offload and not ac:
        read.problems.append("enable_activation_offloading=True needs enable_activation_checkpointing=True.")
    return {"enable_activation_checkpointing": ac, "enable_activation_offloading": act_offload}


def _collate_fn(read: _Reader) -> str:
    """The batch collate function: importable, and one for training."""
    path = str(read.get("collate_fn", _DEFAULT_COLLATE))
    if "left_pad_sequence" in path:
        read.problems.append(f"collate_fn={path}: left_pad_sequence is for inference. Use {_DEFAULT_COLLATE}.")
        return path
    try:
        _get_component_from_path(path)
    except Exception as err:  # torchtune raises its own InstantiationError for any import failure
        read.problems.append(f"collate_fn={path}: cannot be imported ({err}). Use {_DEFAULT_COLLATE}.")
    return path


def _lora_problems(read: _Reader, chosen: Optional[ChosenOptimizer]) -> List[str]:
    """The LoRA recipe's own rules: ``model.lora_attn_modules`` names only layers torchtune can
    adapt (a typo is found now, not at the first save); no ``low_cpu_ram``."""
    problems = _device_weights_problems(read.cfg, chosen, "the LoRA recipe trains adapters only: the frozen base weights "
                                        "are not the optimizer's, so it has no master to quantize (QLoRA keeps "
                                        "them in NF4)")
    if read.flag("low_cpu_ram", False):
        problems.append("low_cpu_ram=True is not supported by this recipe. Set low_cpu_ram=False.")
    valid = list(typing.get_args(LORA_ATTN_MODULES))
    modules = read.cfg.model.get("lora_attn_modules")
    if modules is None:
        return problems
    if isinstance(modules, str) or not OmegaConf.is_list(modules):
        return problems + [f"model.lora_attn_modules={modules!r}: must be a list drawn from {valid}."]
    for name in modules:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f"Did you mean '{close[0]}'?" if close else f"Use names from {valid}."
            problems.append(f"model.lora_attn_modules: {name!r} is not a layer LoRA can adapt. {hint}")
    return problems


def _distributed_problems(read: _Reader, chosen: Optional[ChosenOptimizer]) -> List[str]:
    """The distributed recipe's own rules: what it does not support, the shard policy, CPU
    offload, and the optimizer under FSDP2."""
    cfg = read.cfg
    problems = _device_weights_problems(cfg, chosen, "FSDP2 shards each weight across ranks as a DTensor, which the FP8 "
                                        "layers do not take, and its own CPU offload keeps no FP8 image")
    if read.get("tensor_parallel_dim", 1) not in (1, None):
        problems.append("tensor_parallel_dim > 1 is not supported by this recipe. Set tensor_parallel_dim=1.")
    for key in ("tensor_parallel_plan", "ac_mode", "ac_option"):
        if cfg.get(key) is not None:
            problems.append(f"{key} is not supported by this recipe. Remove it (~{key}).")
    if read.flag("enable_async_checkpointing", False):
        problems.append("enable_async_checkpointing=True is not supported. Set it to False.")
    _, policy = policy_problems(cfg.get("fsdp_shard_policy"), custom_sharded_layers=cfg.get("custom_sharded_layers"))
    problems.extend(policy)
    if cfg.get("fsdp_cpu_offload") is True and str(cfg.get("device", "")).split(":")[0] == "cpu":
        problems.append(
            "fsdp_cpu_offload=True with device=cpu: FSDP2's CPUOffloadPolicy moves shards between an "
            "accelerator and the host, and on a CPU device they are on the host already. Set "
            "fsdp_cpu_offload=False."
        )
    if chosen is not None and chosen.kind is OptimizerKind.SHARDED_ENGINE:
        # The engine steps each rank's shards (distributed/sharded_offload.py), after backward.
        problems.extend(sharded_option_problems(chosen.offload, reported=("device_weights",)))
        if read.get("fsdp_cpu_offload", False) is True:
            problems.append("fsdp_cpu_offload=True with optimizer._component_=torchtune_offload.OffloadOptimizer: "
                            "FSDP2 would keep the shards on the host and step there, and the engine keeps host "
                            "copies of its own. Set fsdp_cpu_offload=False: the engine's states live on the host.")
        return problems
    # A component refused for another reason (torchao's on a CPU device) is still named here.
    caps = chosen.capabilities if chosen is not None else component_capabilities(cfg.optimizer)
    if caps is not None and not caps.runs_under_fsdp2:
        problems.append(
            f"optimizer._component_={cfg.optimizer._component_} is not supported under FSDP2: "
            f"{caps.why_not('runs_under_fsdp2')}. FSDP2 offloads by itself: set "
            "optimizer._component_=torch.optim.AdamW and fsdp_cpu_offload=True (sharded parameters, "
            "gradients and AdamW state then live on the host, where the step runs on all cores)."
        )
    return problems


def _profile_all_threads(cfg: DictConfig, problems: List[str]) -> bool:
    """``profiler.all_threads`` (this project's key; default: true unless ``profile_memory``)."""
    section = cfg.get("profiler")
    if not isinstance(section, DictConfig):
        return True
    value, memory = section.get("all_threads"), section.get("profile_memory", False)
    if value is None:
        return not memory
    if not isinstance(value, bool):
        problems.append(f"profiler.all_threads={value!r}: must be True or False (or left out).")
    elif value and memory:
        problems.append(
            "profiler.all_threads=True with profiler.profile_memory=True: torch records no memory events "
            "while it profiles every thread. Set profiler.all_threads=False to profile memory, or "
            "profiler.profile_memory=False to see the engine's host threads."
        )
    return value is True


def _device_weights_problems(cfg: DictConfig, chosen: Optional[ChosenOptimizer], why: str) -> List[str]:
    """``optimizer.device_weights`` in a recipe that cannot hold FP8 device weights, with why (read
    as the config gives it where another problem kept the optimizer from being described)."""
    value = chosen.device_weights if chosen is not None else configured_device_weights(cfg.get("optimizer"))
    if value is None:
        return []
    return [f"optimizer.device_weights={value} with this recipe: {why}. Remove it (~optimizer.device_weights), "
            "or use the single-device full fine-tune recipe (full_finetune_single_device)."]


def _format(problems: List[str]) -> str:
    return "Invalid config:\n  - " + "\n  - ".join(problems)
