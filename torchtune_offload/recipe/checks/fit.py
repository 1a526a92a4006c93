"""Will this run fit the machine? Answered before anything is loaded, here for the recipes'
pre-flight (``checks/preflight.py``) and the planner alike: the host's memory
(:func:`host_memory_need`, :func:`check_host_memory`) and, for a CUDA run, whether the weights
the recipe loads onto the device fit its free memory (:func:`check_weights_fit_device`,
:func:`check_lora_model_fits_device`).

Host memory is what our users run out of, and a run that does not fit is killed by the kernel
minutes later, after loading, with no message. The recipes call :func:`check_host_memory` in their
``__init__``: the model is built on the meta device (shapes only), the optimizer sizes its own host
buffers and state (``torchtune_offload.optim.host_memory``), and the peak of the two phases below
is compared with the memory available:

- loading the checkpoint: the checkpoint files, plus the model itself when ``device=cpu``;
- training: the model and its gradients when ``device=cpu``, and the optimizer's host memory.

Not counted: activations of a ``device=cpu`` run, and the data loader. ``host_memory_check=False``
turns the check off.

The distributed recipe asks :func:`sharded_host_memory_need` instead, for the whole node: its ranks
share the host's memory. Rank 0 reads the checkpoint; with ``device=cpu`` or ``fsdp_cpu_offload``
each rank keeps its FSDP2 shards of the parameters, their gradients and the optimizer state on the
host (with ``fsdp_cpu_offload`` the parameter and gradient shards are pinned one by one, so each is
rounded up to a power of two by torch's pinned allocator).
"""

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import psutil
import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtune import config, training, utils

from torchtune_offload.optim.host_arena import pinned_allocation_bytes
from torchtune_offload.optim.host_buffers import nbytes
from torchtune_offload.optim.host_memory import HostMemoryPlan, optimizer_state_bytes, plan_host_memory
from torchtune_offload.optim.offload_options import DEVICE_UPDATE_REFUSES
from torchtune_offload.recipe.checkpoints.resume import run_output_dir
from torchtune_offload.recipe.checkpoints.step_checkpoints import STATE_FILE, newest_checkpoint
from torchtune_offload.recipe.checks.config import ConfigError, RecipeSettings
from torchtune_offload.recipe.checks.meta_nf4 import nf4_on_meta_without_arithmetic
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, OptimizerKind

GIB = 1024**3
log = utils.get_logger("INFO")

@dataclass
class HostMemoryNeed:
    """What a run needs on the host beyond what the process holds now, by phase, in bytes.

    Attributes:
        phases: phase -> (purpose -> bytes).
        available: host memory available to the process now.
        notes: what the figures leave out or assume.
    """

    phases: Dict[str, Dict[str, int]]
    available: int
    notes: List[str] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max((sum(parts.values()) for parts in self.phases.values()), default=0)

    @property
    def fits(self) -> bool:
        return self.peak <= self.available

    def describe(self) -> str:
        lines = []
        for phase, parts in self.phases.items():
            items = ", ".join(f"{k} {v / GIB:.2f}" for k, v in parts.items()) or "nothing"
            lines.append(f"  {phase}: {sum(parts.values()) / GIB:.2f} GiB ({items})")
        return "\n".join(lines)


def available_host_memory() -> int:
    """Bytes this process may still allocate: the system's available memory, or the cgroup's limit if lower."""
    available = psutil.virtual_memory().available
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def _checkpoint_bytes(cfg_checkpointer: DictConfig) -> Tuple[int, Optional[str]]:
    """Bytes of the checkpoint files the checkpointer will load, or a note when they cannot be sized.

    The single-device recipes read the configured weights from ``checkpoint_dir`` even when they
    resume (the trained ones then come from a step checkpoint, tensor by tensor).
    """
    files = cfg_checkpointer.get("checkpoint_files")
    directory = Path(str(cfg_checkpointer.get("checkpoint_dir", ".")))
    if not OmegaConf.is_list(files) and not isinstance(files, list):
        return 0, "the checkpoint files are given as a pattern: their size is not counted"
    paths = [directory / str(f) for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        return 0, f"checkpoint files not found ({missing[0]}{', ...' if len(missing) > 1 else ''}): not counted"
    return sum(p.stat().st_size for p in paths), None


def meta_model(cfg_model: DictConfig, settings: RecipeSettings) -> nn.Module:
    """The configured model on the meta device, in the run's dtype: shapes without memory (NF4
    base weights without their quantisation's arithmetic, :mod:`.meta_nf4`)."""
    with training.set_default_dtype(settings.dtype), torch.device("meta"), nf4_on_meta_without_arithmetic():
        return config.instantiate(cfg_model)


def optimizer_plan(chosen: ChosenOptimizer, trainable: List[Tuple[str, torch.Tensor]],
                   settings: RecipeSettings) -> HostMemoryPlan:
    """The host memory of the optimizer ``chosen`` for the ``trainable`` parameters (by name)."""
    # As build_optimizer passes them: offloaders take names, plain optimizers tensors.
    params = trainable if chosen.capabilities.named_parameters else [p for _, p in trainable]
    return plan_host_memory(chosen.optimizer_class, params, device=settings.device,
                            gradient_accumulation_steps=settings.gradient_accumulation_steps,
                            options=dict(chosen.options))


def host_memory_need(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    mark_trainable: Optional[Callable[[nn.Module], Any]] = None,
    optimizer: Optional[ChosenOptimizer] = None,
    device: Optional[torch.device] = None,
    step_bytes: Optional[int] = None,
    model: Optional[nn.Module] = None,
) -> HostMemoryNeed:
    """The host memory the run ``cfg`` describes will need, computed on the meta device.

    Args:
        cfg: the recipe config.
        settings: its checked settings.
        mark_trainable: sets ``requires_grad`` on the meta model as the recipe will (LoRA: adapters only).
        optimizer: size the run with this optimizer instead of ``settings.optimizer`` (for
            suggestions: the configured one with some options changed).
        device: size the run on this device instead (for suggestions).
        step_bytes: for a ``device=cpu`` run, the traced peak of its training step (weights,
            gradients, activations: ``torchtune_offload.plan``), counted in place of the weights
            and gradients; without it activations are not counted.
        model: ``cfg.model`` on the meta device with its trainable parameters marked, where the
            caller has built it (the planner: an 8B model takes a tenth of a second or more to
            build); built here (and ``mark_trainable`` applied) when None.
    """
    if device is not None:
        settings = replace(settings, device=device)
    chosen = optimizer or settings.optimizer
    if model is None:
        model = meta_model(cfg.model, settings)
        if mark_trainable is not None:
            mark_trainable(model)
    on_cpu = settings.device.type == "cpu"
    notes = ["activations of a device=cpu run are not counted"] if on_cpu and step_bytes is None else []
    load: Dict[str, int] = {}
    ckpt, note = _checkpoint_bytes(cfg.checkpointer)
    notes += [note] if note else []
    load["checkpoint files"] = ckpt
    train: Dict[str, int] = {}
    if on_cpu:
        _add_model_on_the_host(model, load=load, train=train, step_bytes=step_bytes,
                               grads_freed=chosen.offload_gradients)
    plan = optimizer_plan(chosen, [(n, p) for n, p in model.named_parameters() if p.requires_grad], settings)
    train.update(plan.parts)
    notes += list(plan.notes)
    newest = newest_checkpoint(run_output_dir(cfg)) if settings.resume_from_checkpoint else None
    if newest is not None:
        # torch.load holds the saved training state (the optimizer's) while it is copied in.
        train["optimizer state being loaded"] = (newest / STATE_FILE).stat().st_size
    return HostMemoryNeed(
        phases={"loading the checkpoint": {k: v for k, v in load.items() if v},
                "training": {k: v for k, v in train.items() if v}},
        available=available_host_memory(),
        notes=notes,
    )


def _add_model_on_the_host(model: nn.Module, *, load: Dict[str, int], train: Dict[str, int],
                           step_bytes: Optional[int], grads_freed: bool) -> None:
    """A ``device=cpu`` run's model in host memory: its weights while loading; while training the
    traced step where there is one, else the weights and (unless the optimizer frees them during
    backward) the gradients."""
    weights = sum(nbytes(t) for t in model.parameters()) + sum(nbytes(b) for b in model.buffers())
    load["model"] = weights
    if step_bytes is not None:
        train["training step (traced: weights, gradients, activations)"] = step_bytes
        return
    train["model"] = weights
    if not grads_freed:
        train["gradients"] = sum(nbytes(p) for p in model.parameters() if p.requires_grad)


def meta_shard(param: torch.Tensor, world_size: int) -> torch.Tensor:
    """One rank's FSDP2 shard of ``param`` on the meta device: dim 0 split in ``world_size``
    equal parts, padded (FSDP2 allocates every rank's shard at the padded size)."""
    if param.dim() == 0:
        return torch.empty((), dtype=param.dtype, device="meta")
    rows = -(-param.shape[0] // world_size)
    return torch.empty((rows, *param.shape[1:]), dtype=param.dtype, device="meta")


def trainable_shards(model: nn.Module, *, world_size: int) -> List[Tuple[str, torch.Tensor]]:
    """One rank's shards of ``model``'s trainable parameters by name (:func:`meta_shard`), marked
    trainable: what each rank's optimizer is built over."""
    return [(n, meta_shard(p, world_size).requires_grad_()) for n, p in model.named_parameters() if p.requires_grad]


def sharded_host_memory_need(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    world_size: int,
    local_world_size: int,
    fsdp_cpu_offload: Optional[bool] = None,
) -> HostMemoryNeed:
    """The host memory of one node of an FSDP2 run: ``local_world_size`` of its ``world_size`` ranks.

    Args:
        cfg: the distributed recipe's config.
        settings: its checked settings.
        world_size: ranks in the run.
        local_world_size: ranks on this node (they share its memory).
        fsdp_cpu_offload: size the run with this setting instead (for suggestions).
    """
    offload = settings.fsdp_cpu_offload if fsdp_cpu_offload is None else fsdp_cpu_offload
    model = meta_model(cfg.model, settings)
    params = list(model.parameters())
    shards = [meta_shard(p, world_size) for p in params]
    named_trainable = trainable_shards(model, world_size=world_size)
    trainable = [shard for _, shard in named_trainable]
    on_host = settings.device.type == "cpu" or offload
    notes = ["activations and the layers FSDP2 gathers for forward and backward of a device=cpu run are not "
             "counted"] if settings.device.type == "cpu" else []

    def held(tensors) -> int:
        # fsdp_cpu_offload pins each shard and each gradient with torch's allocator.
        sizes = [nbytes(t) for t in tensors]
        return local_world_size * sum(pinned_allocation_bytes(n, pinned=offload) for n in sizes)

    load: Dict[str, int] = {}
    ckpt, note = _checkpoint_bytes(cfg.checkpointer)
    notes += [note] if note else []
    load["checkpoint files (rank 0)"] = ckpt
    newest = newest_checkpoint(run_output_dir(cfg)) if settings.resume_from_checkpoint else None
    if newest is not None:
        # Rank 0 holds the step checkpoint's training state (the full optimizer state) beside the
        # configured weights, which its trained weights replace tensor by tensor.
        load["optimizer state being loaded (rank 0)"] = (newest / STATE_FILE).stat().st_size
    train: Dict[str, int] = {}
    chosen = settings.optimizer
    if on_host:
        load["parameter shards"] = train["parameter shards"] = held(shards)
        train["gradient shards"] = held(trainable)
    if chosen.kind is OptimizerKind.SHARDED_ENGINE:
        # Each rank's engine over its own shards, wherever the device is.
        plan = optimizer_plan(chosen, named_trainable, settings)
        for purpose, size in plan.parts.items():
            train[f"{purpose} (engine, all ranks)"] = local_world_size * size
        notes += list(plan.notes)
    elif on_host:
        state, state_notes = optimizer_state_bytes(chosen.base_class, trainable, chosen.base_options)
        train["optimizer state"] = local_world_size * state
        notes += list(state_notes)
    return HostMemoryNeed(
        phases={"loading the checkpoint": {k: v for k, v in load.items() if v},
                "training": {k: v for k, v in train.items() if v}},
        available=available_host_memory(),
        notes=notes,
    )


def _suggestions(cfg: DictConfig, settings: RecipeSettings, need: HostMemoryNeed,
                 mark_trainable: Optional[Callable[[nn.Module], Any]]) -> List[str]:
    """Settings that would change the figure, each with its peak and whether it fits."""
    out = []
    candidates = []
    chosen = settings.optimizer
    if chosen.kind.offloads:
        if chosen.base_class in (torch.optim.AdamW, torch.optim.Adam):
            candidates.append(("optimizer.optimizer_class=torchtune_offload.AdamW8bit (8-bit states, fused host step)",
                               lambda: dict(optimizer=chosen.with_options(optimizer_class="torchtune_offload.AdamW8bit"))))
        if chosen.kind is OptimizerKind.OFFLOAD_ENGINE and chosen.offload.update_on != "device":
            # States alone on the host; the weights and gradients must then fit the device (the planner says).
            # Options update_on=device refuses go with it, so the line is one the user can run as it is.
            overrides = ["optimizer.update_on=device", "optimizer.offload_gradients=False"]
            device_update: Dict[str, Any] = {"update_on": "device", "offload_gradients": False}
            for key, (default, _, _) in DEVICE_UPDATE_REFUSES.items():
                if key not in device_update and getattr(chosen.offload, key) != default:
                    overrides.append(f"~optimizer.{key}")
                    device_update[key] = default
            candidates.append((f"{' '.join(overrides)} (states alone on the host, updates on the device, if the "
                               "weights and gradients fit it)", lambda: dict(optimizer=chosen.with_options(**device_update))))
    if settings.device.type == "cpu" and torch.accelerator.is_available():
        accel = torch.accelerator.current_accelerator()
        candidates.append((f"device={accel.type} (the model on the GPU)", lambda: dict(device=accel)))
    for label, sized_with in candidates:
        try:
            other = host_memory_need(cfg, settings, mark_trainable=mark_trainable, **sized_with())
        except Exception as err:  # e.g. bitsandbytes missing: say so instead of the figure
            out.append(f"  {label}: cannot be sized here ({type(err).__name__}: {err})")
            continue
        verdict = "fits" if other.peak <= need.available else "does not fit either"
        out.append(f"  {label}: {other.peak / GIB:.2f} GiB, {verdict}")
    if mark_trainable is None:
        out.append("  a LoRA recipe (configs/<model>/*_lora_offload.yaml): optimizer state for the adapters only")
    out.append("  host_memory_check=False: run anyway (the kernel may kill the run when memory runs out)")
    return out


def _sharded_suggestions(cfg: DictConfig, settings: RecipeSettings, need: HostMemoryNeed, *, world_size: int,
                         local_world_size: int) -> List[str]:
    out = []
    if settings.fsdp_cpu_offload:
        other = sharded_host_memory_need(cfg, settings, world_size=world_size, local_world_size=local_world_size,
                                         fsdp_cpu_offload=False)
        verdict = "fits" if other.peak <= need.available else "does not fit either"
        out.append(f"  fsdp_cpu_offload=False (shards and optimizer state on the GPUs): {other.peak / GIB:.2f} GiB, "
                   f"{verdict}")
    out.append("  more nodes: each holds its own ranks' shards")
    out.append("  host_memory_check=False: run anyway (the kernel may kill the run when memory runs out)")
    return out


def check_host_memory(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    mark_trainable: Optional[Callable[[nn.Module], Any]] = None,
    ranks: Optional[Tuple[int, int]] = None,
    log_figures: bool = True,
) -> Optional[HostMemoryNeed]:
    """Raises before anything is loaded if the run will not fit the host's memory; logs the figures.

    Args:
        cfg: the recipe config.
        settings: its checked settings (``host_memory_check=False`` skips the check).
        mark_trainable: sets ``requires_grad`` on the meta model as the recipe will.
        ranks: ``(world_size, local_world_size)`` of an FSDP2 run: the node's need is checked
            (:func:`sharded_host_memory_need`).
        log_figures: log the figures of a run that fits (an FSDP2 run's ranks other than a node's
            first pass False: each computes the same node-wide figures).

    Returns:
        The computed need, or ``None`` when the check is off.

    Raises:
        ConfigError: with the figures and the settings that would fit, when the peak exceeds the
            available memory.
    """
    if not settings.host_memory_check:
        if log_figures:
            log.info("Host memory check skipped (host_memory_check=False).")
        return None
    if ranks is None:
        need = host_memory_need(cfg, settings, mark_trainable=mark_trainable)
        who = "this run needs"
    else:
        world_size, local_world_size = ranks
        need = sharded_host_memory_need(cfg, settings, world_size=world_size, local_world_size=local_world_size)
        who = f"the {local_world_size} rank(s) on this node (of {world_size}) need"
    summary = (f"Host memory: {who} about {need.peak / GIB:.2f} GiB beyond what the process holds "
               f"now ({psutil.Process(os.getpid()).memory_info().rss / GIB:.2f} GiB); "
               f"{need.available / GIB:.2f} GiB are available.\n{need.describe()}")
    notes = "".join(f"\n  note: {n}" for n in need.notes)
    if need.fits:
        if log_figures:
            log.info(summary + notes)
        return need
    raise ConfigError(
        f"host_memory_check: the run does not fit this machine's memory. {summary}{notes}\n"
        "Settings that change the figure:\n" + "\n".join(
            _suggestions(cfg, settings, need, mark_trainable) if ranks is None else
            _sharded_suggestions(cfg, settings, need, world_size=ranks[0], local_world_size=ranks[1]))
    )


def check_weights_fit_device(weights: Mapping[str, torch.Tensor], *, device: torch.device, dtype: torch.dtype,
                             device_weights: Optional[str] = None) -> None:
    """Refuses a single-device CUDA run whose weights cannot fit the device's free memory, before
    the model is built there: the recipe puts every weight on the device in ``dtype`` before the
    optimizer exists (with ``optimizer.device_weights`` too, before its FP8 images replace them),
    so such a run would fail with an out-of-memory error part-way through building or loading.

    Args:
        weights: the checkpoint's model tensors (their sizes are the model's).

    Raises:
        ConfigError: naming the weights' size, the device's free memory, and what to do.
    """
    if device.type != "cuda":
        return
    need = sum(t.numel() for t in weights.values()) * dtype.itemsize
    free, total = torch.cuda.mem_get_info(device)
    if need <= free:
        return
    fp8 = (f" (with optimizer.device_weights={device_weights} too: the FP8 images are made from them once the "
           "optimizer exists)") if device_weights else ""
    raise ConfigError(
        f"device={device}: the model's weights are {need / GIB:.2f} GiB in {dtype}, and the recipe loads all of "
        f"them onto the device before the optimizer is built{fp8}, but it has {_free_of(free, total)}, or "
        "fine-tune less of the model (LoRA or QLoRA: configs/<model>/*_lora_offload.yaml, *_qlora_offload.yaml). "
        f"{_PLANNER}")


def check_lora_model_fits_device(cfg_model: DictConfig, settings: RecipeSettings) -> None:
    """Refuses a single-device CUDA run of the LoRA recipe whose model cannot fit the device's free
    memory, before it is built there: the recipe builds the whole model on the device (the base
    weights, in NF4 for QLoRA, and the adapters) and then loads the base weights into it, so such a
    run would fail with an out-of-memory error part-way through the build.

    The checkpoint's size would overstate a QLoRA model by about four times, so the model is the
    configured builder's on the meta device (:func:`meta_model`), NF4 weights counted by the
    tensors they hold. A buffer a builder makes only off the meta device is not counted: llama3.1's
    RoPE cache, 64 MiB.

    Args:
        cfg_model: the config's ``model`` node.
        settings: the checked config's settings (the device and dtype).

    Raises:
        ConfigError: naming the model's size, the device's free memory, and what to do.
    """
    if settings.device.type != "cuda":
        return
    model = meta_model(cfg_model, settings)
    tensors = [*model.parameters(), *model.buffers()]
    need = sum(_nbytes(t) for t in tensors)
    quantized = any(is_traceable_wrapper_subclass(t) for t in tensors)
    free, total = torch.cuda.mem_get_info(settings.device)
    if need <= free:
        return
    what, advice = (("its base weights in NF4", "a smaller model") if quantized else
                    (f"in {settings.dtype}", "with QLoRA, which keeps the base layers' weights in NF4, about a quarter "
                     "of their bf16 size (configs/<model>/*_qlora_offload.yaml: the model's qlora_ builder)"))
    raise ConfigError(
        f"device={settings.device}: the model is {need / GIB:.2f} GiB ({what}, adapters included), and the recipe "
        f"builds all of it on the device before the base weights load, but it has {_free_of(free, total)}, or "
        f"fine-tune {advice}. {_PLANNER}")


_PLANNER = "The planner (tune-offload plan --config <name or path> --device-gib <free GiB>) says what fits."


def _free_of(free: int, total: int) -> str:
    return (f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB. Free the device (another process, or a display, "
            f"holds {(total - free) / GIB:.2f} GiB)")


def _nbytes(tensor: torch.Tensor) -> int:
    """The bytes ``tensor`` takes on its device: for a wrapper subclass (torchao's NF4), its inner tensors'."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(_nbytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()
