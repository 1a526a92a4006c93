"""Building blocks the recipes share, one per step of a recipe's ``setup()``.

torchtune copies these into every recipe; here each exists once and the recipes call them in the
same order: metric logger, checkpoint, model, optimizer, loss, data, LR scheduler, profiler (the
memory monitor is :class:`torchtune_offload.recipe.memory.MemoryMonitor`).
"""

from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.distributed.loss import RowChunkedLoss
from torchtune_offload.optim.offload_optimizer import STATE_DICT_FORMAT, OffloadOptimizer
from torchtune_offload.recipe.config import RecipeSettings
from torchtune_offload.recipe.progress import Progress


def build_metric_logger(cfg: DictConfig) -> Any:
    """The metric logger, with the whole config logged first so a failed setup still records it."""
    metric_logger = config.instantiate(cfg.metric_logger)
    metric_logger.log_config(cfg)
    return metric_logger


def load_checkpoint(
    cfg_checkpointer: DictConfig, settings: RecipeSettings, *, progress: Optional[Progress]
) -> Tuple[Any, Dict[str, Any]]:
    """The checkpointer and what it loads.

    Args:
        cfg_checkpointer: the checkpointer's config.
        settings: the recipe's settings.
        progress: when resuming through torchtune's recipe state (the distributed recipe), takes
            it; ``None`` for recipes that resume from step checkpoints, whose checkpointer loads the
            configured weights only.

    Returns:
        ``(checkpointer, checkpoint_dict)``.
    """
    torchtune_resume = settings.resume_from_checkpoint and progress is not None
    checkpointer = config.instantiate(cfg_checkpointer, should_load_recipe_state=torchtune_resume)
    ckpt = checkpointer.load_checkpoint()
    if torchtune_resume:
        progress.restore(ckpt)
    return checkpointer, ckpt


def instantiate_model(cfg_model: DictConfig, settings: RecipeSettings, *, device: Optional[torch.device] = None) -> nn.Module:
    """Builds the model in the configured dtype, with activation checkpointing and compile applied."""
    with training.set_default_dtype(settings.dtype), (device or settings.device):
        model = config.instantiate(cfg_model)
    if settings.compile:
        training.compile_model(model)
    if settings.enable_activation_checkpointing:
        training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
    return model


def _saved_optimizer_kind(state_dict: Any) -> str:
    """Which kind of optimizer wrote ``state_dict``, read from its layout."""
    if not isinstance(state_dict, dict):
        return f"something that is not an optimizer state ({type(state_dict).__name__})"
    if state_dict.get("format") == STATE_DICT_FORMAT:
        return "torchtune_offload.OffloadOptimizer"
    if "offloaded" in state_dict:
        return "torchao's CPUOffloadOptimizer (torchtune_offload.CPUOffloadOptimizer)"
    if {"state", "param_groups"} <= set(state_dict):
        return "a plain optimizer (torch.optim, bitsandbytes)"
    return "per-parameter optimizers (optimizer_in_bwd=True)"


def _load_optimizer_state(target: Any, state_dict: Dict[str, Any], cfg_optimizer: DictConfig, settings: RecipeSettings) -> None:
    """Loads a saved optimizer state, refusing one written by another kind of optimizer with how to go on."""
    if settings.optimizer_in_bwd:
        mine = "per-parameter optimizers (optimizer_in_bwd=True)"
    elif issubclass(settings.optimizer_class, OffloadOptimizer):
        mine = "torchtune_offload.OffloadOptimizer"
    elif settings.optimizer_capabilities.offloads:
        mine = "torchao's CPUOffloadOptimizer (torchtune_offload.CPUOffloadOptimizer)"
    else:
        mine = "a plain optimizer (torch.optim, bitsandbytes)"
    saved = _saved_optimizer_kind(state_dict)
    if saved == mine and mine.startswith("a plain optimizer"):
        # Plain optimizers of different classes differ in their options (AdamW's betas, SGD's momentum).
        # initial_lr is an LR scheduler's bookkeeping, added once one is built.
        ignored = {"params", "initial_lr"}
        saved_options = set(state_dict["param_groups"][0]) - ignored if state_dict["param_groups"] else set()
        my_options = set(target.param_groups[0]) - ignored
        if saved_options != my_options:
            saved = f"a plain optimizer with the options {sorted(saved_options)}, not {sorted(my_options)}"
    if saved != mine:
        raise ValueError(
            f"resume_from_checkpoint=True: the checkpoint's optimizer state was written by {saved}, and this "
            f"run's optimizer is {mine} (optimizer._component_={cfg_optimizer._component_}, "
            f"optimizer_in_bwd={settings.optimizer_in_bwd}). Resume with the optimizer settings that wrote "
            "it, or start fresh from the saved weights with resume_from_checkpoint=False."
        )
    target.load_state_dict(state_dict)


def build_optimizer(
    cfg_optimizer: DictConfig,
    model: nn.Module,
    settings: RecipeSettings,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
) -> Tuple[Optional[torch.optim.Optimizer], Optional[Any]]:
    """Builds the optimizer; with ``optimizer_in_bwd`` one per parameter stepping in backward.

    Returns:
        ``(optimizer, None)``, or ``(None, in_backward_wrapper)`` with ``optimizer_in_bwd``.
    """
    if settings.optimizer_in_bwd:
        optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in model.parameters() if p.requires_grad}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        wrapper = training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict)
        if state_dict is not None:
            _load_optimizer_state(wrapper, state_dict, cfg_optimizer, settings)
        return None, wrapper
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if settings.optimizer_capabilities.named_parameters:
        # Names key the offload optimizer's checkpoint, so a reordered model cannot load wrong state.
        optimizer = config.instantiate(cfg_optimizer, trainable)
    else:
        # Plain, bitsandbytes and torchao's optimizers take tensors, as in torchtune's recipes.
        optimizer = config.instantiate(cfg_optimizer, [p for _, p in trainable])
    if settings.optimizer_capabilities.overlaps_host_step:
        # With overlap on, step() returns at once and each module waits for its own weights.
        optimizer.register_forward_waits(model)
    if state_dict is not None:
        _load_optimizer_state(optimizer, state_dict, cfg_optimizer, settings)
    return optimizer, None


def close_optimizer(optimizer: Optional[torch.optim.Optimizer], settings: RecipeSettings) -> None:
    """Finishes an overlapping optimizer's host work and stops its worker threads (cleanup)."""
    if optimizer is not None and settings.optimizer_capabilities.overlaps_host_step:
        optimizer.close()


def build_loss(cfg_loss: DictConfig, model: nn.Module, settings: RecipeSettings, *, verbose: bool = True) -> nn.Module:
    """The loss, compiled if configured; a chunked loss also sets the model's output chunks.

    Args:
        verbose: let torchtune log the compilation (rank zero only, in the distributed recipe).
    """
    loss_fn = config.instantiate(cfg_loss)
    if settings.compile:
        training.compile_loss(loss_fn, verbose=verbose)
    if isinstance(loss_fn, CEWithChunkedOutputLoss):
        if isinstance(getattr(model, "output", None), FSDPModule):
            # An FSDP2 unit must run once per forward, not once per chunk.
            loss_fn = RowChunkedLoss(loss_fn)
        else:
            model.set_num_output_chunks(loss_fn.num_output_chunks)
    return loss_fn


def build_dataloader(
    cfg_dataset: Any,
    cfg_tokenizer: DictConfig,
    settings: RecipeSettings,
    *,
    ignore_index: int,
    world_size: int = 1,
    rank: int = 0,
) -> StatefulDataLoader:
    """The tokenizer and the training dataloader; its order depends only on the epoch (``sampler.set_epoch``)."""
    tokenizer = config.instantiate(cfg_tokenizer)
    if isinstance(cfg_dataset, ListConfig):
        ds = ConcatDataset(datasets=[config.instantiate(c, tokenizer) for c in cfg_dataset])
        packed = getattr(ds, "packed", False)
    else:
        ds = config.instantiate(cfg_dataset, tokenizer)
        packed = cfg_dataset.get("packed", False)
    if "left_pad_sequence" in settings.collate_fn:
        raise ValueError("collate_fn: left_pad_sequence is for inference. Use torchtune.data.padded_collate_sft.")
    collate = _get_component_from_path(settings.collate_fn)
    sampler = StatefulDistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=settings.shuffle, seed=0)
    loader = StatefulDataLoader(
        dataset=ds,
        batch_size=settings.batch_size,
        sampler=sampler,
        collate_fn=(
            padded_collate_packed
            if packed
            else partial(collate, padding_idx=tokenizer.pad_id, ignore_idx=ignore_index)
        ),
        drop_last=True,
    )
    if len(loader) < settings.gradient_accumulation_steps:
        raise ValueError(
            f"gradient_accumulation_steps={settings.gradient_accumulation_steps} exceeds the "
            f"{len(loader)} batches of one epoch (batch_size={settings.batch_size}). Lower one of them."
        )
    return loader


def build_lr_scheduler(
    cfg_lr_scheduler: Optional[DictConfig],
    *,
    optimizer: Optional[torch.optim.Optimizer],
    in_bwd_wrapper: Optional[Any],
    dataloader: StatefulDataLoader,
    settings: RecipeSettings,
    epochs_run: int,
    steps_run_in_epoch: int = 0,
) -> Optional[Any]:
    """The LR scheduler over the whole run, positioned after ``epochs_run`` epochs and
    ``steps_run_in_epoch`` more steps, or ``None``.

    With ``optimizer_in_bwd`` it is built on one per-parameter optimizer and drives all of them.
    """
    if cfg_lr_scheduler is None:
        return None
    num_steps = steps_per_epoch(dataloader, settings)
    source = optimizer if optimizer is not None else next(iter(in_bwd_wrapper.optim_map.values()))
    scheduler = config.instantiate(
        cfg_lr_scheduler, source,
        num_training_steps=settings.epochs * num_steps, last_epoch=epochs_run * num_steps + steps_run_in_epoch - 1,
    )
    if in_bwd_wrapper is not None:
        in_bwd_wrapper.set_lr_scheduler(scheduler)
        # torchtune's wrapper copies the learning rate to every optimizer after each scheduler
        # step only; without this the first step would run at the configured rate (not the
        # scheduler's, e.g. 0 at the start of a warm-up) on every parameter but one.
        lr = scheduler.get_last_lr()[0]
        for opt in in_bwd_wrapper.optim_map.values():
            for group in opt.param_groups:
                group["lr"] = lr
    return scheduler


def build_profiler(cfg_profiler: Optional[DictConfig]) -> Any:
    """torchtune's torch profiler, or its no-op stand-in when disabled."""
    if cfg_profiler is None:
        cfg_profiler = DictConfig({"enabled": False})
    component = cfg_profiler.get("_component_", None)
    if component is None:
        cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
    elif component != "torchtune.training.setup_torch_profiler":
        raise ValueError(
            f"profiler._component_={component}: only torchtune.training.setup_torch_profiler is supported."
        )
    profiler, _ = config.instantiate(cfg_profiler)
    return profiler


def optimizer_state(optimizer: Optional[Any], in_bwd_wrapper: Optional[Any]) -> Dict[str, Any]:
    """The optimizer part of an intermediate checkpoint."""
    return (optimizer if optimizer is not None else in_bwd_wrapper).state_dict()


def steps_per_epoch(loader: StatefulDataLoader, settings: RecipeSettings) -> int:
    """Optimizer steps in one epoch: whole windows of the loader, capped by ``max_steps_per_epoch``."""
    steps = len(loader) // settings.gradient_accumulation_steps
    if settings.max_steps_per_epoch is not None:
        steps = min(steps, settings.max_steps_per_epoch)
    return steps
