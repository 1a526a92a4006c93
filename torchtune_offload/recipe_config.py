"""Reading and checking a recipe's config before anything large is allocated.

torchtune's recipes read keys with ``cfg.get(key, default)``, so a typo silently falls back to the
default. Here every top-level key must be known to the recipe, every value is checked, and every
problem found is reported in one ``ValueError`` that names the key and the fix.
"""

import difflib
from dataclasses import dataclass
from enum import Enum
from typing import Any, List, Optional

import torch
from omegaconf import DictConfig
from torchtune.config._utils import _get_component_from_path

# Keys of torchtune 0.6.1's single-device configs, which our recipes accept unchanged.
_SINGLE_DEVICE_KEYS = {
    "batch_size", "checkpointer", "clip_grad_norm", "collate_fn", "compile", "cudnn_deterministic_mode",
    "dataset", "device", "dtype", "enable_activation_checkpointing", "enable_activation_offloading",
    "epochs", "gradient_accumulation_steps", "log_every_n_steps", "log_peak_memory_stats", "loss",
    "lr_scheduler", "max_steps_per_epoch", "metric_logger", "model", "optimizer", "output_dir",
    "profiler", "resume_from_checkpoint", "seed", "shuffle", "tokenizer",
}
RECIPE_KEYS = {
    "full": _SINGLE_DEVICE_KEYS | {"optimizer_in_bwd"},
    "lora": _SINGLE_DEVICE_KEYS | {"save_adapter_weights_only", "low_cpu_ram"},
    "distributed": _SINGLE_DEVICE_KEYS | {
        "optimizer_in_bwd", "fsdp_cpu_offload", "fsdp_reshard_after_forward", "fsdp_shard_policy",
        "custom_sharded_layers", "tensor_parallel_dim", "tensor_parallel_plan", "ac_mode", "ac_option",
        "enable_async_checkpointing",
    },
}
_REQUIRED = ("model", "tokenizer", "dataset", "checkpointer", "optimizer", "loss", "metric_logger",
             "output_dir", "batch_size", "epochs", "device", "dtype")


class OptimizerKind(Enum):
    """How the configured optimizer relates to the gradients a recipe computes."""

    PLAIN = "plain"  # steps on the model's .grad tensors
    OFFLOAD = "offload"  # torchtune_offload.OffloadOptimizer: clips and scales what it steps on
    TORCHAO = "torchao"  # torchao's: copies grads during backward, cannot clip


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
    optimizer_kind: OptimizerKind
    offload_gradients: bool
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


def _is_int(v: Any, *, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def optimizer_kind(cfg_optimizer: DictConfig) -> OptimizerKind:
    """Classifies ``cfg.optimizer`` by its ``_component_``.

    Raises:
        ValueError: if ``optimizer._component_`` is missing or does not resolve.
    """
    from torchtune_offload.ao_offload import CPUOffloadOptimizer
    from torchtune_offload.offload_optimizer import OffloadOptimizer

    path = cfg_optimizer.get("_component_") if isinstance(cfg_optimizer, DictConfig) else None
    if not path:
        raise ValueError("optimizer._component_ is missing. Set it, e.g. optimizer._component_=torch.optim.AdamW.")
    try:
        component = _get_component_from_path(path)
    except Exception as err:
        raise ValueError(
            f"optimizer._component_={path!r} does not resolve ({err}). Use e.g. torch.optim.AdamW, "
            "torchtune_offload.OffloadOptimizer or bitsandbytes.optim.PagedAdamW."
        ) from err
    if isinstance(component, type) and issubclass(component, OffloadOptimizer):
        return OptimizerKind.OFFLOAD
    if isinstance(component, type) and issubclass(component, CPUOffloadOptimizer):
        return OptimizerKind.TORCHAO
    import torchao.optim

    if isinstance(component, type) and issubclass(component, torchao.optim.CPUOffloadOptimizer):
        raise ValueError(
            f"optimizer._component_={path}: torchao's class takes optimizer_class as a class, which a "
            "config cannot hold. Use optimizer._component_=torchtune_offload.CPUOffloadOptimizer."
        )
    return OptimizerKind.PLAIN


def check_recipe_config(cfg: DictConfig, *, recipe: str) -> RecipeSettings:
    """Validates ``cfg`` for ``recipe`` ("full", "lora" or "distributed") and reads its settings.

    Raises:
        ValueError: listing every problem found, each naming its key and the fix.
    """
    from torchtune import training, utils

    from torchtune_offload.optimizer_class import resolve_optimizer_class

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

    batch_size = cfg.batch_size
    epochs = cfg.epochs
    accum = get("gradient_accumulation_steps", 1)
    max_steps = get("max_steps_per_epoch", None)
    log_every = get("log_every_n_steps", 1)
    clip = get("clip_grad_norm", None)
    in_bwd = bool(get("optimizer_in_bwd", False))
    for key, value, low in (("batch_size", batch_size, 1), ("epochs", epochs, 1),
                            ("gradient_accumulation_steps", accum, 1), ("log_every_n_steps", log_every, 1)):
        if not _is_int(value, low=low):
            problems.append(f"{key}={value!r}: must be an integer >= {low}.")
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

    kind = OptimizerKind.PLAIN
    offload_gradients = False
    try:
        kind = optimizer_kind(cfg.optimizer)
    except ValueError as err:
        problems.append(str(err))
    if kind is not OptimizerKind.PLAIN:
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
    dtype_name = str(cfg.dtype)
    if dtype_name not in ("fp32", "bf16"):
        problems.append(f"dtype={dtype_name!r}: use bf16 or fp32 (fp16 full training is not supported).")
    is_cuda = device_name.startswith("cuda")

    if in_bwd:
        if kind is not OptimizerKind.PLAIN:
            problems.append(
                f"optimizer_in_bwd=True with optimizer._component_={cfg.optimizer._component_}: an offloading "
                "optimizer cannot step inside backward with exact gradient math. Set optimizer_in_bwd=False."
            )
        if clip is not None:
            problems.append("optimizer_in_bwd=True with clip_grad_norm set: clipping needs all gradients "
                            "before any step. Set clip_grad_norm=null or optimizer_in_bwd=False.")
        if _is_int(accum, low=2):
            problems.append("optimizer_in_bwd=True with gradient_accumulation_steps > 1: each backward "
                            "steps at once. Set gradient_accumulation_steps=1 or optimizer_in_bwd=False.")
    if kind is OptimizerKind.TORCHAO:
        if clip is not None:
            problems.append(
                "clip_grad_norm is set but optimizer._component_=torchtune_offload.CPUOffloadOptimizer "
                "(torchao's) steps on gradients copied during backward and cannot clip them. Set "
                "clip_grad_norm=null, or optimizer._component_=torchtune_offload.OffloadOptimizer."
            )
        if offload_gradients is True and _is_int(accum, low=2):
            problems.append(
                "gradient_accumulation_steps > 1 with torchtune_offload.CPUOffloadOptimizer and "
                "optimizer.offload_gradients=True: torchao keeps only the last micro-batch. Set "
                "gradient_accumulation_steps=1, or optimizer._component_=torchtune_offload.OffloadOptimizer."
            )
        if device_name.split(":")[0] not in ("cuda", "xpu"):
            problems.append(
                f"device={device_name} with torchtune_offload.CPUOffloadOptimizer: torchao's optimizer needs "
                "CUDA or XPU. Use optimizer._component_=torchtune_offload.OffloadOptimizer."
            )

    ac = bool(get("enable_activation_checkpointing", False))
    act_offload = bool(get("enable_activation_offloading", False))
    if act_offload and not is_cuda:
        problems.append("enable_activation_offloading=True needs device=cuda. Set it to False.")
    if act_offload and not ac:
        problems.append("enable_activation_offloading=True needs enable_activation_checkpointing=True.")

    if recipe == "lora" and get("low_cpu_ram", False):
        problems.append("low_cpu_ram=True is not supported by this recipe. Set low_cpu_ram=False.")
    if recipe == "distributed":
        if get("tensor_parallel_dim", 1) not in (1, None):
            problems.append("tensor_parallel_dim > 1 is not supported by this recipe. Set tensor_parallel_dim=1.")
        for key in ("tensor_parallel_plan", "ac_mode", "ac_option"):
            if cfg.get(key) is not None:
                problems.append(f"{key} is not supported by this recipe. Remove it (~{key}).")
        if get("enable_async_checkpointing", False):
            problems.append("enable_async_checkpointing=True is not supported. Set it to False.")
        from torchtune_offload.fsdp_policies import fsdp_config_problems

        problems.extend(fsdp_config_problems(cfg, optimizer_kind=kind))

    if problems:
        raise ValueError(_format(problems))

    device = utils.get_device(device=device_name)
    return RecipeSettings(
        device=device,
        dtype=training.get_dtype(dtype_name, device=device),
        batch_size=batch_size,
        epochs=epochs,
        max_steps_per_epoch=max_steps,
        gradient_accumulation_steps=accum,
        clip_grad_norm=clip,
        optimizer_in_bwd=in_bwd,
        optimizer_kind=kind,
        offload_gradients=bool(offload_gradients),
        compile=bool(get("compile", False)),
        enable_activation_checkpointing=ac,
        enable_activation_offloading=act_offload,
        log_every_n_steps=log_every,
        log_peak_memory_stats=bool(get("log_peak_memory_stats", True)),
        resume_from_checkpoint=bool(get("resume_from_checkpoint", False)),
        seed=cfg.get("seed"),
        shuffle=bool(get("shuffle", True)),
        collate_fn=str(get("collate_fn", "torchtune.data.padded_collate_sft")),
        cudnn_deterministic_mode=cfg.get("cudnn_deterministic_mode"),
        save_adapter_weights_only=bool(get("save_adapter_weights_only", False)),
        fsdp_cpu_offload=bool(get("fsdp_cpu_offload", False)),
        fsdp_reshard_after_forward=bool(get("fsdp_reshard_after_forward", True)),
    )


def _format(problems: List[str]) -> str:
    return "Invalid config:\n  - " + "\n  - ".join(problems)

