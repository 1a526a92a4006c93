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

from torchtune_offload.recipe_config import check_recipe_config
from torchtune_offload.recipe_setup import (
    Progress,
    build_optimizer,
    build_train_loop,
    instantiate_model,
    optimizer_state,
)

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
        self.progress = Progress.start(self.settings)

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
        # 4. Data, loss, schedule, profiler and memory figures, wired into the shared loop.
        self._loop = build_train_loop(
            cfg, s, model=self._model, optimizer=self._optimizer, in_bwd_wrapper=self._in_bwd,
            epochs_run=self.progress.epochs_run, metric_logger=self._metric_logger,
            activations_ctx=self._activations_ctx,
        )

    def save_checkpoint(self, epoch: int) -> None:
        ckpt = {training.MODEL_KEY: self._model.state_dict()}
        intermediate = epoch + 1 < self.settings.epochs
        if intermediate:
            self.progress.epochs_run = epoch + 1
            ckpt.update(self.progress.state())
            ckpt[training.OPT_KEY] = optimizer_state(self._optimizer, self._in_bwd)
            # Resume restarts at an epoch boundary, where the sampler's order depends only on
            # the epoch; the loader state is stored for torchtune's tools, not read back.
            ckpt[training.DATALOADER_KEY] = self._loop.dataloader.state_dict()
        self._checkpointer.save_checkpoint(ckpt, epoch=epoch, intermediate_checkpoint=intermediate)

    def train(self) -> None:
        self.progress.epochs_run = self._loop.run(epochs_run=self.progress.epochs_run, save_checkpoint=self.save_checkpoint)

    def cleanup(self) -> None:
        self._loop.memory.close()
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
