"""Building blocks the recipes share: model, optimizer, data, scheduler, profiler, progress.

torchtune copies these into every recipe; here each exists once and the recipes call it.
"""

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
from omegaconf import DictConfig, ListConfig
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed
from torchtune.datasets import ConcatDataset

from torchtune_offload.recipe_config import OptimizerKind, RecipeSettings

if TYPE_CHECKING:
    from torchtune_offload.train_loop import TrainLoop

log = utils.get_logger("INFO")


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
            wrapper.load_state_dict(state_dict)
        return None, wrapper
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if settings.optimizer_kind is OptimizerKind.PLAIN:
        # Plain and bitsandbytes optimizers take tensors, as in torchtune's recipes.
        optimizer = config.instantiate(cfg_optimizer, [p for _, p in trainable])
    else:
        # Names key the offload optimizer's checkpoint, so a reordered model cannot load wrong state.
        optimizer = config.instantiate(cfg_optimizer, trainable)
    if state_dict is not None:
        optimizer.load_state_dict(state_dict)
    return optimizer, None


def build_dataloader(
    cfg_dataset: Any,
    tokenizer: Any,
    settings: RecipeSettings,
    *,
    ignore_index: int,
    world_size: int = 1,
    rank: int = 0,
) -> StatefulDataLoader:
    """The training dataloader; its order depends only on the epoch (``sampler.set_epoch``)."""
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
    optimizer: Any,
    *,
    num_training_steps: int,
    last_epoch: int,
) -> Optional[Any]:
    """The LR scheduler, or ``None`` for a constant learning rate."""
    if cfg_lr_scheduler is None:
        return None
    return config.instantiate(cfg_lr_scheduler, optimizer, num_training_steps=num_training_steps, last_epoch=last_epoch)


def build_profiler(cfg_profiler: Optional[DictConfig]) -> Tuple[Any, Dict[str, Any]]:
    """torchtune's torch profiler (or its no-op stand-in when disabled) and its settings."""
    if cfg_profiler is None:
        cfg_profiler = DictConfig({"enabled": False})
    component = cfg_profiler.get("_component_", None)
    if component is None:
        cfg_profiler["_component_"] = "torchtune.training.setup_torch_profiler"
    elif component != "torchtune.training.setup_torch_profiler":
        raise ValueError(
            f"profiler._component_={component}: only torchtune.training.setup_torch_profiler is supported."
        )
    profiler, profiler_cfg = config.instantiate(cfg_profiler)
    return profiler, dict(profiler_cfg)


@dataclass
class Progress:
    """Where training stands; saved in intermediate checkpoints to resume at an epoch boundary."""

    seed: int
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]

    @classmethod
    def start(cls, settings: RecipeSettings, *, seed: Optional[int] = None) -> "Progress":
        """Seeds the RNGs (``seed`` overrides the config's, e.g. per rank) and starts at epoch 0."""
        seed = training.set_seed(
            seed=settings.seed if seed is None else seed, debug_mode=settings.cudnn_deterministic_mode
        )
        return cls(seed=seed, epochs_run=0, total_epochs=settings.epochs, max_steps_per_epoch=settings.max_steps_per_epoch)

    def restore(self, ckpt: Dict[str, Any]) -> None:
        """Takes the saved state of a checkpoint, warning where the config disagrees."""
        try:
            self.epochs_run = ckpt[training.EPOCHS_KEY]
            for key, attr in ((training.SEED_KEY, "seed"), (training.MAX_STEPS_KEY, "max_steps_per_epoch")):
                if getattr(self, attr) != ckpt[key]:
                    log.warning(f"config {attr}={getattr(self, attr)} differs from the checkpoint's "
                                f"{ckpt[key]}; using the checkpoint's.")
                    setattr(self, attr, ckpt[key])
        except KeyError as err:
            raise ValueError(
                f"resume_from_checkpoint=True but the recipe state lacks {err}; it was not written by "
                "an intermediate checkpoint of this recipe. Set resume_from_checkpoint=False."
            ) from err

    def state(self) -> Dict[str, Any]:
        return {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
        }


def optimizer_state(optimizer: Optional[Any], in_bwd_wrapper: Optional[Any]) -> Dict[str, Any]:
    """The optimizer part of an intermediate checkpoint."""
    return (optimizer if optimizer is not None else in_bwd_wrapper).state_dict()


def lr_source(optimizer: Optional[Any], in_bwd_wrapper: Optional[Any]) -> Any:
    """What LR schedulers and ``get_lr`` act on."""
    if optimizer is not None:
        return optimizer
    return next(iter(in_bwd_wrapper.optim_map.values()))


def attach_scheduler(in_bwd_wrapper: Optional[Any], scheduler: Optional[Any]) -> None:
    """With optimizer_in_bwd, one scheduler drives all per-parameter optimizers."""
    if in_bwd_wrapper is not None and scheduler is not None:
        in_bwd_wrapper.set_lr_scheduler(scheduler)
        # torchtune's wrapper copies the learning rate to every optimizer after each scheduler
        # step only; without this the first step would run at the configured rate (not the
        # scheduler's, e.g. 0 at the start of a warm-up) on every parameter but one.
        lr = scheduler.get_last_lr()[0]
        for opt in in_bwd_wrapper.optim_map.values():
            for group in opt.param_groups:
                group["lr"] = lr


def steps_per_epoch(loader: StatefulDataLoader, settings: RecipeSettings) -> int:
    steps = len(loader) // settings.gradient_accumulation_steps
    if settings.max_steps_per_epoch is not None:
        steps = min(steps, settings.max_steps_per_epoch)
    return steps


SaveFn = Callable[[int], None]


def build_train_loop(
    cfg: DictConfig,
    settings: RecipeSettings,
    *,
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer],
    in_bwd_wrapper: Optional[Any],
    epochs_run: int,
    metric_logger: Any,
    activations_ctx: Any,
    world_size: int = 1,
    rank: int = 0,
) -> "TrainLoop":
    """Tokenizer, loss, data, LR schedule, profiler and memory monitor, wired into a TrainLoop."""
    from torchtune_offload.grad_math import GradientStepper
    from torchtune_offload.memory import MemoryMonitor
    from torchtune_offload.train_loop import TrainLoop

    tokenizer = config.instantiate(cfg.tokenizer)
    loss_fn = config.instantiate(cfg.loss)
    if settings.compile:
        training.compile_loss(loss_fn)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)
    loader = build_dataloader(
        cfg.dataset, tokenizer, settings, ignore_index=loss_fn.ignore_index, world_size=world_size, rank=rank
    )
    num_steps = steps_per_epoch(loader, settings)
    source = lr_source(optimizer, in_bwd_wrapper)
    scheduler = build_lr_scheduler(
        cfg.get("lr_scheduler"), source,
        num_training_steps=settings.epochs * num_steps,
        last_epoch=epochs_run * num_steps - 1,
    )
    attach_scheduler(in_bwd_wrapper, scheduler)
    profiler, _ = build_profiler(cfg.get("profiler"))
    log.info(
        f"{num_steps} steps per epoch x {settings.epochs} epochs; optimizer "
        f"{type(optimizer if optimizer is not None else in_bwd_wrapper).__name__} ({settings.optimizer_kind.value})."
    )
    return TrainLoop(
        model=model,
        loss_fn=loss_fn,
        dataloader=loader,
        stepper=GradientStepper(
            optimizer=optimizer, params=model.parameters(),
            kind=settings.optimizer_kind, clip_grad_norm=settings.clip_grad_norm,
        ),
        lr_source=in_bwd_wrapper if in_bwd_wrapper is not None else source,
        lr_scheduler=scheduler,
        profiler=profiler,
        metric_logger=metric_logger,
        memory=MemoryMonitor(settings.device, optimizer=optimizer),
        settings=settings,
        steps_per_epoch=num_steps,
        activations_ctx=activations_ctx,
        is_rank_zero=rank == 0,
    )
