"""Building blocks the recipes share, one per step of a recipe's ``setup()``.

torchtune copies these into every recipe; here each exists once and the recipes call them in the
same order: metric logger, data, checkpoint, model, optimizer, loss, LR scheduler, profiler (the
memory monitor is :class:`torchtune_offload.recipe.reports.memory.MemoryMonitor`).
"""

from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset
from torchtune.modules.loss import CEWithChunkedOutputLoss

from torchtune_offload.distributed.loss import RowChunkedLoss
from torchtune_offload.distributed.sharded_offload import ShardedOffloadOptimizer
from torchtune_offload.recipe.checks.component_options import nulled
from torchtune_offload.recipe.checks.config import RecipeSettings
from torchtune_offload.recipe.chosen_optimizer import OptimizerKind
from torchtune_offload.recipe.dataset_build import build_dataset, dataset_nodes
from torchtune_offload.recipe.progress import Progress
from torchtune_offload.recipe.run_optimizer import (
    HoldingOptimizer,
    InBackwardOptimizers,
    OwnGradientsOptimizer,
    RunOptimizer,
)

log = utils.get_logger("INFO")


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


def build_optimizer(
    cfg_optimizer: DictConfig,
    model: nn.Module,
    settings: RecipeSettings,
    *,
    state_dict: Optional[Dict[str, Any]] = None,
) -> RunOptimizer:
    """Builds the run's optimizer behind the recipes' one optimizer interface: with
    ``optimizer_in_bwd`` one per parameter stepping in backward; when resuming, with its state.

    Raises:
        ValueError: if ``state_dict`` was written by another kind of optimizer.
    """
    chosen = settings.optimizer
    if chosen.kind is OptimizerKind.SHARDED_ENGINE:
        # The engine over each rank's FSDP2 shards, measuring and clipping the gradients over every
        # rank as FSDP2 with torch's AdamW would.
        sharded = ShardedOffloadOptimizer(model.named_parameters(), **chosen.options)
        run = HoldingOptimizer(sharded, model=model, clip_grad_norm=settings.clip_grad_norm, kind=chosen.kind)
    elif chosen.kind is OptimizerKind.IN_BACKWARD:
        optim_dict = {p: config.instantiate(cfg_optimizer, [p]) for p in model.parameters() if p.requires_grad}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optim_dict)
        run = InBackwardOptimizers(training.create_optim_in_bwd_wrapper(model=model, optim_dict=optim_dict))
    else:
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # Names key the offload optimizer's checkpoint, so a reordered model cannot load wrong state;
        # plain, bitsandbytes and torchao's optimizers take tensors, as in torchtune's recipes.
        named = chosen.capabilities.named_parameters
        optimizer = config.instantiate(cfg_optimizer, trainable if named else [p for _, p in trainable])
        if getattr(optimizer, "is_paged", False) and trainable and trainable[0][1].device.type == "cpu":
            # bitsandbytes says so only in a warning at the first step, which reads as a detail.
            log.warning(f"optimizer._component_={chosen.component}: bitsandbytes pages its states only on "
                        "CUDA and runs unpaged on the CPU, so this run's speed and memory are not those of a paged "
                        "optimizer on a GPU.")
        clip = settings.clip_grad_norm
        if chosen.kind is OptimizerKind.OFFLOAD_ENGINE:
            run = HoldingOptimizer(optimizer, model=model, clip_grad_norm=clip)
        elif chosen.kind is OptimizerKind.TORCHAO_OFFLOAD:
            run = OwnGradientsOptimizer(optimizer, clip_grad_norm=clip, kind=chosen.kind)
        else:
            run = RunOptimizer(optimizer, params=[p for _, p in trainable], clip_grad_norm=clip, kind=chosen.kind)
    if state_dict is not None:
        run.load_state_dict(state_dict, component=cfg_optimizer._component_)
    return run


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


def loss_ignore_index(cfg_loss: DictConfig) -> int:
    """The label id the configured loss ignores, which the collate function pads labels with: read
    before the model exists, so the data can be built (and fail) before any weight is read."""
    return config.instantiate(cfg_loss).ignore_index


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
        ds = ConcatDataset(datasets=[build_dataset(c, tokenizer, key=key) for key, c in dataset_nodes(cfg_dataset)])
        packed = getattr(ds, "packed", False)
    else:
        ds = build_dataset(cfg_dataset, tokenizer, key="dataset")
        packed = cfg_dataset.get("packed", False)
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
    cfg_lr_scheduler: Optional[DictConfig], *, optimizer: RunOptimizer, progress: Progress,
) -> Optional[Any]:
    """The LR scheduler over the whole run, positioned at ``progress``'s global step, or ``None``
    where the config has none or nulls its component (``lr_scheduler=null`` on the command line)."""
    if cfg_lr_scheduler is None:
        return None
    if nulled(cfg_lr_scheduler):
        print("[torchtune_offload] lr_scheduler._component_ is null: no schedule, the learning rate stays at "
              "optimizer.lr")
        return None
    scheduler = config.instantiate(
        cfg_lr_scheduler, optimizer.scheduled,
        num_training_steps=progress.total_steps, last_epoch=progress.global_step - 1,
    )
    optimizer.attach_lr_scheduler(scheduler)
    return scheduler


def build_profiler(cfg_profiler: Optional[DictConfig], *, all_threads: bool) -> Any:
    """torchtune's torch profiler, or its no-op stand-in when disabled.

    Args:
        cfg_profiler: the config's ``profiler`` section, if any; its ``all_threads`` key (this
            project's, read into the settings) is left out of what torchtune gets.
        all_threads: record every thread (``RecipeSettings.profile_all_threads``), so that the
            engine's host threads (the overlap step, the staging ring's additions) and their
            ``offload/...`` ranges are in the trace; ``python scripts/profile_summary.py
            <profiler.output_dir>`` reads it.
    """
    if cfg_profiler is None or nulled(cfg_profiler):  # profiler=null on the command line: no profiler
        cfg_profiler = DictConfig({"enabled": False})
    cfg_profiler = cfg_profiler.copy()
    component = cfg_profiler.get("_component_", None)
    if component is None:
        cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
    elif component != "torchtune.training.setup_torch_profiler":
        raise ValueError(
            f"profiler._component_={component}: only torchtune.training.setup_torch_profiler is supported."
        )
    cfg_profiler.pop("all_threads", None)
    profiler, _ = config.instantiate(cfg_profiler)
    if all_threads and isinstance(profiler, torch.profiler.profile):
        # torchtune builds the profiler without this option; torch reads it when the profiler
        # starts. verbose is what torchtune sets where stacks are recorded, which they need.
        profiler.experimental_config = torch._C._profiler._ExperimentalConfig(
            verbose=profiler.with_stack, profile_all_threads=True)
    return profiler
