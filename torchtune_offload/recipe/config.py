"""Reading and checking a recipe's config before anything large is allocated.

torchtune's recipes read keys with ``cfg.get(key, default)``, so a typo silently falls back to the
default. Here every top-level key must be known to the recipe, every value is checked, and every
problem found is reported in one ``ValueError`` that names the key and the fix.
"""

import difflib
import inspect
import typing
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torchao.optim
from omegaconf import DictConfig, OmegaConf
from torchtune import training, utils
from torchtune.modules.peft import LORA_ATTN_MODULES

from torchtune_offload.distributed.policies import policy_problems
from torchtune_offload.optim.capabilities import OptimizerCapabilities, capabilities_of
from torchtune_offload.optim.optimizer_class import resolve_optimizer, resolve_optimizer_class

# Keys of torchtune 0.6.1's single-device configs, which our recipes accept unchanged.
_SINGLE_DEVICE_KEYS = {
    "batch_size", "checkpointer", "clip_grad_norm", "collate_fn", "compile", "cudnn_deterministic_mode",
    "dataset", "device", "dtype", "enable_activation_checkpointing", "enable_activation_offloading",
    "epochs", "gradient_accumulation_steps", "log_every_n_steps", "log_peak_memory_stats", "loss",
    "lr_scheduler", "max_steps_per_epoch", "metric_logger", "model", "optimizer", "output_dir",
    "profiler", "resume_from_checkpoint", "seed", "shuffle", "tokenizer", "overwrite_checkpoints",
}
# Resumable checkpoints at any step (recipe/step_checkpoints.py): the single-device recipes.
_STEP_CHECKPOINT_KEYS = ("save_every_n_steps", "keep_last_n_checkpoints")
RECIPE_KEYS = {
    "full": _SINGLE_DEVICE_KEYS | {"optimizer_in_bwd", "host_memory_check", *_STEP_CHECKPOINT_KEYS},
    "lora": _SINGLE_DEVICE_KEYS | {"save_adapter_weights_only", "low_cpu_ram", "host_memory_check",
                                   *_STEP_CHECKPOINT_KEYS},
    "distributed": _SINGLE_DEVICE_KEYS | {
        "optimizer_in_bwd", "fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_shard_policy",
        "custom_sharded_layers", "tensor_parallel_dim", "tensor_parallel_plan", "ac_mode", "ac_option",
        "enable_async_checkpointing", "host_memory_check",
    },
}
_REQUIRED = ("model", "tokenizer", "dataset", "checkpointer", "optimizer", "loss", "metric_logger",
             "output_dir", "batch_size", "epochs", "device", "dtype")


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
    optimizer_in_bwd: bool
    optimizer_class: type
    optimizer_capabilities: OptimizerCapabilities
    compile: bool
    enable_activation_checkpointing: bool
    enable_activation_offloading: bool
    log_every_n_steps: int
    log_peak_memory_stats: bool
    resume_from_checkpoint: bool
    seed: Optional[int]
    shuffle: bool
    collate_fn: str
    cudnn_deterministic_mode: Optional[bool]
    save_adapter_weights_only: bool
    fsdp_cpu_offload: bool
    fsdp_reshard_after_forward: bool
    host_memory_check: bool
    save_every_n_steps: Optional[int] = None
    keep_last_n_checkpoints: int = 2


def _is_int(v: Any, *, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def resolve_optimizer_component(cfg_optimizer: Any) -> Tuple[type, OptimizerCapabilities]:
    """The class ``cfg.optimizer._component_`` names, and what it can do.

    Raises:
        ValueError: if ``optimizer._component_`` is missing, does not resolve, or names torchao's
            own class (whose ``optimizer_class`` a config cannot hold).
    """
    path = cfg_optimizer.get("_component_") if isinstance(cfg_optimizer, DictConfig) else None
    if not path:
        raise ValueError("optimizer._component_ is missing. Set it, e.g. optimizer._component_=torch.optim.AdamW.")
    component = resolve_optimizer(path, key="optimizer._component_")
    capabilities = capabilities_of(component)
    if not capabilities.offloads and issubclass(component, torchao.optim.CPUOffloadOptimizer):
        raise ValueError(
            f"optimizer._component_={path}: torchao's class takes optimizer_class as a class, which a "
            "config cannot hold. Use optimizer._component_=torchtune_offload.CPUOffloadOptimizer."
        )
    return component, capabilities


def check_recipe_config(cfg: DictConfig, *, recipe: str, device_present: bool = True) -> RecipeSettings:
    """Validates ``cfg`` for ``recipe`` ("full", "lora" or "distributed") and reads its settings.

    Args:
        cfg: the recipe config.
        recipe: which recipe reads it.
        device_present: require the configured device on this machine (a run does); the memory
            planner, which plans a GPU run on any machine, passes False.

    Raises:
        ValueError: listing every problem found, each naming its key and the fix.
    """
    known = RECIPE_KEYS[recipe]
    problems: List[str] = []
    for key in cfg.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else " Remove it (~" + str(key) + ")."
            problems.append(f"{key}: unknown config key for this recipe.{hint}")
    for key in _REQUIRED:
        if cfg.get(key) is None:
            problems.append(f"{key}: required; set it in the config or with {key}=... on the command line.")
    if problems:
        raise ValueError(_format(problems))

    def get(key: str, default: Any) -> Any:
        value = cfg.get(key, default)
        return default if value is None and default is not None else value

    def flag(key: str, default: bool) -> bool:
        # bool("Flase") is True: a misspelt word must not switch a feature on.
        value = get(key, default)
        if not isinstance(value, bool):
            problems.append(f"{key}={value!r}: must be True or False.")
            return default
        return value

    batch_size = cfg.batch_size
    epochs = cfg.epochs
    accum = get("gradient_accumulation_steps", 1)
    max_steps = get("max_steps_per_epoch", None)
    log_every = get("log_every_n_steps", 1)
    clip = get("clip_grad_norm", None)
    in_bwd = flag("optimizer_in_bwd", False)
    flags = {key: flag(key, default) for key, default in (
        ("compile", False), ("log_peak_memory_stats", True), ("resume_from_checkpoint", False),
        ("shuffle", True), ("save_adapter_weights_only", False), ("host_memory_check", True),
        ("overwrite_checkpoints", False),
        # Keys of the distributed recipe only; the others reject them as unknown above.
        ("fsdp_cpu_offload", False), ("fsdp_reshard_after_forward", True),
    )}
    for key, value, low in (("batch_size", batch_size, 1), ("epochs", epochs, 1),
                            ("gradient_accumulation_steps", accum, 1), ("log_every_n_steps", log_every, 1)):
        if not _is_int(value, low=low):
            problems.append(f"{key}={value!r}: must be an integer >= {low}.")
    save_every = get("save_every_n_steps", None)
    keep_last = get("keep_last_n_checkpoints", 2)
    if save_every is not None and not _is_int(save_every, low=1):
        problems.append(f"save_every_n_steps={save_every!r}: must be null (checkpoints at epoch ends only) or an "
                        "integer >= 1.")
    if not _is_int(keep_last, low=1):
        problems.append(f"keep_last_n_checkpoints={keep_last!r}: must be an integer >= 1 (the newest checkpoints "
                        "kept in output_dir/checkpoints; older ones are removed).")
    if max_steps is not None and not _is_int(max_steps, low=1):
        problems.append(f"max_steps_per_epoch={max_steps!r}: must be null or an integer >= 1.")
    if clip is not None:
        try:
            clip = float(clip)
            if not clip > 0:
                raise ValueError
        except (TypeError, ValueError):
            problems.append(f"clip_grad_norm={clip!r}: must be null or a positive number ('inf' logs the norm only).")
            clip = None

    optimizer_class, caps = None, None
    offload_gradients = False
    try:
        optimizer_class, caps = resolve_optimizer_component(cfg.optimizer)
    except ValueError as err:
        problems.append(str(err))
    if caps is not None and caps.offloads:
        offload_gradients = cfg.optimizer.get("offload_gradients", False)
        if not isinstance(offload_gradients, bool):
            problems.append(f"optimizer.offload_gradients={offload_gradients!r}: must be True or False.")
        try:
            resolve_optimizer_class(cfg.optimizer.get("optimizer_class", "torch.optim.AdamW"))
        except ValueError as err:
            problems.append(str(err))

    device_name = str(cfg.device)
    if device_name.split(":")[0] not in ("cpu", "cuda", "xpu", "npu", "mps"):
        problems.append(f"device={device_name!r}: use cpu, cuda or xpu.")
    requested = device_name.split(":")[0]
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
    is_cuda = device_name.startswith("cuda")

    if caps is not None:
        problems.extend(_optimizer_problems(
            cfg, caps, in_bwd=in_bwd, clip=clip, accum=accum,
            offload_gradients=offload_gradients is True, device_type=device_name.split(":")[0],
        ))
    if caps is not None and optimizer_class is not None:
        # One problem per key: keys the rules above reported are not listed again, and the probe,
        # which would repeat those rules, is built only when they all passed.
        reported = {p.split("=")[0].split(":")[0] for p in problems if p.startswith("optimizer.")}
        problems.extend(_optimizer_option_problems(cfg.optimizer, optimizer_class, caps, reported=reported))
    if in_bwd:
        if clip is not None:
            problems.append("optimizer_in_bwd=True with clip_grad_norm set: clipping needs all gradients "
                            "before any step. Set clip_grad_norm=null or optimizer_in_bwd=False.")
        if _is_int(accum, low=2):
            problems.append("optimizer_in_bwd=True with gradient_accumulation_steps > 1: each backward "
                            "steps at once. Set gradient_accumulation_steps=1 or optimizer_in_bwd=False.")

    ac = flag("enable_activation_checkpointing", False)
    act_offload = flag("enable_activation_offloading", False)
    if act_offload and not is_cuda:
        problems.append("enable_activation_offloading=True needs device=cuda. Set it to False.")
    if act_offload and not ac:
        problems.append("enable_activation_offloading=True needs enable_activation_checkpointing=True.")

    if recipe == "lora":
        problems.extend(_lora_module_problems(cfg.model))
    if recipe == "lora" and flag("low_cpu_ram", False):
        problems.append("low_cpu_ram=True is not supported by this recipe. Set low_cpu_ram=False.")
    if recipe == "distributed":
        if get("tensor_parallel_dim", 1) not in (1, None):
            problems.append("tensor_parallel_dim > 1 is not supported by this recipe. Set tensor_parallel_dim=1.")
        for key in ("tensor_parallel_plan", "ac_mode", "ac_option"):
            if cfg.get(key) is not None:
                problems.append(f"{key} is not supported by this recipe. Remove it (~{key}).")
        if flag("enable_async_checkpointing", False):
            problems.append("enable_async_checkpointing=True is not supported. Set it to False.")
        problems.extend(_distributed_problems(cfg, caps))

    if problems:
        raise ValueError(_format(problems))

    if device_present:
        device = utils.get_device(device=device_name)
        dtype = training.get_dtype(dtype_name, device=device)
    else:
        device, dtype = torch.device(device_name), {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    return RecipeSettings(
        device=device,
        dtype=dtype,
        batch_size=batch_size,
        epochs=epochs,
        max_steps_per_epoch=max_steps,
        gradient_accumulation_steps=accum,
        clip_grad_norm=clip,
        optimizer_in_bwd=in_bwd,
        optimizer_class=optimizer_class,
        optimizer_capabilities=caps,
        compile=flags["compile"],
        enable_activation_checkpointing=ac,
        enable_activation_offloading=act_offload,
        log_every_n_steps=log_every,
        log_peak_memory_stats=flags["log_peak_memory_stats"],
        resume_from_checkpoint=flags["resume_from_checkpoint"],
        seed=cfg.get("seed"),
        shuffle=flags["shuffle"],
        collate_fn=str(get("collate_fn", "torchtune.data.padded_collate_sft")),
        cudnn_deterministic_mode=cfg.get("cudnn_deterministic_mode"),
        save_adapter_weights_only=flags["save_adapter_weights_only"],
        fsdp_cpu_offload=flags["fsdp_cpu_offload"],
        fsdp_reshard_after_forward=flags["fsdp_reshard_after_forward"],
        host_memory_check=flags["host_memory_check"],
        save_every_n_steps=save_every,
        keep_last_n_checkpoints=keep_last,
    )


def _lora_module_problems(cfg_model: DictConfig) -> List[str]:
    """``model.lora_attn_modules`` names only layers torchtune can adapt; a typo is found now, not at the first save."""
    valid = list(typing.get_args(LORA_ATTN_MODULES))
    modules = cfg_model.get("lora_attn_modules")
    if modules is None:
        return []
    if isinstance(modules, str) or not OmegaConf.is_list(modules):
        return [f"model.lora_attn_modules={modules!r}: must be a list drawn from {valid}."]
    problems = []
    for name in modules:
        if name not in valid:
            close = difflib.get_close_matches(str(name), valid, n=1)
            hint = f"Did you mean '{close[0]}'?" if close else f"Use names from {valid}."
            problems.append(f"model.lora_attn_modules: {name!r} is not a layer LoRA can adapt. {hint}")
    return problems


def _keyword_names(cls: type, *, kwargs_go_elsewhere: bool = False) -> Optional[set]:
    """The keyword options ``cls(params, ...)`` takes, or None if it takes any (``**kwargs``).

    Args:
        kwargs_go_elsewhere: ``**kwargs`` are forwarded to another class (an offloader's base
            optimizer), whose own names are checked separately.
    """
    names = set()
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[2:]:  # self, params
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if kwargs_go_elsewhere:
                continue
            return None
        if param.kind is not inspect.Parameter.VAR_POSITIONAL:
            names.add(name)
    return names


def _optimizer_option_problems(
    cfg_optimizer: DictConfig, component: type, caps: OptimizerCapabilities, *, reported: set
) -> List[str]:
    """Unknown ``optimizer:`` keys (with the closest valid name) and values the optimizer refuses.

    The optimizer is built on a one-element CPU parameter, so its own checks run before any weight
    is read; only the base optimizer is built for an offloader that needs an accelerator (torchao's).
    """
    options = {k: v for k, v in OmegaConf.to_container(cfg_optimizer, resolve=True).items() if k != "_component_"}
    base = None
    if caps.offloads:
        try:
            base = resolve_optimizer_class(options.get("optimizer_class", "torch.optim.AdamW"))
        except ValueError:
            return []  # reported by the optimizer_class check
    own = _keyword_names(component, kwargs_go_elsewhere=base is not None)
    theirs = _keyword_names(base) if base is not None else set()
    problems = []
    if own is not None and theirs is not None:
        valid = own | theirs
        for key in sorted(set(options) - valid - {k.split(".", 1)[1] for k in reported}):
            close = difflib.get_close_matches(key, sorted(valid), n=1)
            hint = f"Did you mean '{close[0]}'?" if close else f"Valid options: {', '.join(sorted(valid))}."
            name = component.__name__ + (f" (base {base.__name__})" if base is not None else "")
            problems.append(f"optimizer.{key}: not an option of {name}. {hint}")
    if problems or reported:
        return problems
    param = torch.nn.Parameter(torch.zeros(1))
    try:
        if caps.offloads and caps.device_types is not None:
            base([param], **{k: v for k, v in options.items() if k not in (own or ())})
        elif caps.named_parameters:
            component([("probe", param)], **options)
        else:
            component([param], **options)
    except (ValueError, TypeError, RuntimeError) as err:
        problems.append(f"optimizer: {component.__name__} refuses its options: {err}")
    return problems


def _optimizer_problems(
    cfg: DictConfig,
    caps: OptimizerCapabilities,
    *,
    in_bwd: bool,
    clip: Optional[float],
    accum: Any,
    offload_gradients: bool,
    device_type: str,
) -> List[str]:
    """What the run asks of the optimizer that its declared capabilities rule out."""
    component = cfg.optimizer._component_
    problems = []
    if in_bwd and not caps.steps_in_backward:
        problems.append(
            f"optimizer_in_bwd=True with optimizer._component_={component}: "
            f"{caps.why_not('steps_in_backward')}. Set optimizer_in_bwd=False."
        )
    if clip is not None and not caps.can_clip:
        problems.append(
            f"clip_grad_norm is set but optimizer._component_={component} cannot clip: "
            f"{caps.why_not('can_clip')}. Set clip_grad_norm=null, or "
            "optimizer._component_=torchtune_offload.OffloadOptimizer."
        )
    if offload_gradients and _is_int(accum, low=2) and not caps.accumulates_offloaded_grads:
        problems.append(
            f"gradient_accumulation_steps > 1 with {component} and optimizer.offload_gradients=True: "
            f"{caps.why_not('accumulates_offloaded_grads')}. Set gradient_accumulation_steps=1, "
            "optimizer.offload_gradients=False, or optimizer._component_=torchtune_offload.OffloadOptimizer."
        )
    for key in ("master_dtype", "grad_sum_dtype"):
        value = cfg.optimizer.get(key)
        if value is None:
            continue
        # Values are checked where the optimizer is built on a probe (_optimizer_option_problems).
        if not caps.precision_policy:
            problems.append(f"optimizer.{key}={value} with {component}: {caps.why_not('precision_policy')}. "
                            f"Remove it (~optimizer.{key}).")
    if caps.device_types is not None and device_type not in caps.device_types:
        problems.append(
            f"device={cfg.device} with {component}: {caps.why_not('device_types')}. Use "
            "optimizer._component_=torchtune_offload.OffloadOptimizer, which runs on any device."
        )
    return problems


def _distributed_problems(cfg: DictConfig, caps: Optional[OptimizerCapabilities]) -> List[str]:
    """The distributed recipe's own rules: shard policy, CPU offload, and the optimizer under FSDP2."""
    _, problems = policy_problems(
        cfg.get("fsdp_shard_policy"), custom_sharded_layers=cfg.get("custom_sharded_layers")
    )
    if cfg.get("fsdp_cpu_offload") is True and str(cfg.get("device", "")).split(":")[0] == "cpu":
        problems.append(
            "fsdp_cpu_offload=True with device=cpu: FSDP2's CPUOffloadPolicy moves shards between an "
            "accelerator and the host, and on a CPU device they are on the host already. Set "
            "fsdp_cpu_offload=False."
        )
    if caps is not None and not caps.runs_under_fsdp2:
        problems.append(
            f"optimizer._component_={cfg.optimizer._component_} is not supported under FSDP2: "
            f"{caps.why_not('runs_under_fsdp2')}. FSDP2 offloads by itself: set "
            "optimizer._component_=torch.optim.AdamW and fsdp_cpu_offload=True (sharded parameters, "
            "gradients and AdamW state then live on the host, where the step runs on all cores)."
        )
    return problems


def _format(problems: List[str]) -> str:
    return "Invalid config:\n  - " + "\n  - ".join(problems)

