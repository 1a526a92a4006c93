"""Full fine-tuning on one device, with any optimizer, offloading or not, and exact gradient math.

Takes torchtune 0.6.1's ``full_finetune_single_device`` configs unchanged. Swap in optimizer
offload from the command line::

    tune run recipes/full_finetune_single_device.py --config configs/tiny/full.yaml \\
        optimizer._component_=torchtune_offload.OffloadOptimizer \\
        optimizer.optimizer_class=torch.optim.AdamW optimizer.offload_gradients=True

Unlike torchtune's recipe, gradients are normalised by the window's token count before backward,
so clipping, accumulation and the logged grad_norm apply to the gradients the optimizer steps on.
"""

import sys

from omegaconf import DictConfig
from torchtune import config, training, utils

from torchtune_offload.grad_math import GradientStepper
from torchtune_offload.memory import MemoryMonitor
from torchtune_offload.recipe_config import check_recipe_config
from torchtune_offload.recipe_setup import (
    Progress,
    attach_scheduler,
    build_dataloader,
    build_lr_scheduler,
    build_optimizer,
    build_profiler,
    instantiate_model,
    lr_source,
    optimizer_state,
    steps_per_epoch,
)
from torchtune_offload.train_loop import TrainLoop

log = utils.get_logger("INFO")


class FullFinetuneRecipeSingleDevice:
    """Full fine-tuning of a decoder on one device.

    Args:
        cfg: the parsed config; every key is checked here, before anything is allocated.

    Raises:
        ValueError: listing every invalid key, value or combination of the config.
    """

    def __init__(self, cfg: DictConfig) -> None:
        self.settings = check_recipe_config(cfg, recipe="full")
        seed = training.set_seed(seed=cfg.get("seed"), debug_mode=self.settings.cudnn_deterministic_mode)
        self.progress = Progress(
            seed=seed, epochs_run=0, total_epochs=self.settings.epochs,
            max_steps_per_epoch=self.settings.max_steps_per_epoch,
        )

    def setup(self, cfg: DictConfig) -> None:
        s = self.settings
        # 1. Logging first, so that the config is recorded even if a later step fails.
        self._metric_logger = config.instantiate(cfg.metric_logger)
        self._metric_logger.log_config(cfg)
        # 2. Weights (and, when resuming, the recipe state) from the checkpointer.
        self._checkpointer = config.instantiate(cfg.checkpointer, should_load_recipe_state=s.resume_from_checkpoint)
        ckpt = self._checkpointer.load_checkpoint()
        if s.resume_from_checkpoint:
            self.progress.restore(ckpt)
        # 3. Model, then the optimizer that holds references to its parameters.
        self._model = instantiate_model(cfg.model, s)
        self._model.load_state_dict(ckpt[training.MODEL_KEY])
        training.validate_expected_param_dtype(self._model.named_parameters(), dtype=s.dtype)
        self._activations_ctx = training.get_act_offloading_ctx_manager(self._model, s.enable_activation_offloading)
        self._optimizer, self._in_bwd = build_optimizer(
            cfg.optimizer, self._model, s,
            state_dict=ckpt.get(training.OPT_KEY) if s.resume_from_checkpoint else None,
        )
        # 4. Loss and data.
        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        if s.compile:
            training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            self._model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        self._dataloader = build_dataloader(cfg.dataset, self._tokenizer, s, ignore_index=self._loss_fn.ignore_index)
        # 5. Schedule, profiler, memory figures.
        self._steps_per_epoch = steps_per_epoch(self._dataloader, s)
        source = lr_source(self._optimizer, self._in_bwd)
        self._lr_scheduler = build_lr_scheduler(
            cfg.get("lr_scheduler"), source,
            num_training_steps=s.epochs * self._steps_per_epoch,
            last_epoch=self.progress.epochs_run * self._steps_per_epoch - 1,
        )
        attach_scheduler(self._in_bwd, self._lr_scheduler)
        profiler, _ = build_profiler(cfg.get("profiler"))
        self._memory = MemoryMonitor(s.device, optimizer=self._optimizer)
        self._loop = TrainLoop(
            model=self._model, loss_fn=self._loss_fn, dataloader=self._dataloader,
            stepper=GradientStepper(
                optimizer=self._optimizer, params=self._model.parameters(),
                kind=s.optimizer_kind, clip_grad_norm=s.clip_grad_norm,
            ),
            lr_source=self._in_bwd if self._in_bwd is not None else source,
            lr_scheduler=self._lr_scheduler, profiler=profiler, metric_logger=self._metric_logger,
            memory=self._memory, settings=s, steps_per_epoch=self._steps_per_epoch,
            activations_ctx=self._activations_ctx,
        )
        log.info(f"Setup done: {self._steps_per_epoch} steps per epoch, optimizer {type(self._optimizer or self._in_bwd).__name__}.")

    def save_checkpoint(self, epoch: int) -> None:
        ckpt = {training.MODEL_KEY: self._model.state_dict()}
        intermediate = epoch + 1 < self.settings.epochs
        if intermediate:
            self.progress.epochs_run = epoch + 1
            ckpt.update(self.progress.state())
            ckpt[training.OPT_KEY] = optimizer_state(self._optimizer, self._in_bwd)
            # Resume restarts at an epoch boundary, where the sampler's order depends only on
            # the epoch; the loader state is stored for torchtune's tools, not read back.
            ckpt[training.DATALOADER_KEY] = self._dataloader.state_dict()
        self._checkpointer.save_checkpoint(ckpt, epoch=epoch, intermediate_checkpoint=intermediate)

    def train(self) -> None:
        self.progress.epochs_run = self._loop.run(epochs_run=self.progress.epochs_run, save_checkpoint=self.save_checkpoint)

    def cleanup(self) -> None:
        self._memory.close()
        self._metric_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/full_finetune_single_device.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    recipe.setup(cfg=cfg)
    try:
        recipe.train()
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
