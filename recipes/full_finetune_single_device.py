"""Full fine-tuning on one device, with any optimizer, offloading or not, and exact gradient math.

Takes torchtune 0.6.1's ``full_finetune_single_device`` configs unchanged. Swap in optimizer
offload from the command line::

    tune run recipes/full_finetune_single_device.py --config configs/tiny/full.yaml \\
        optimizer._component_=torchtune_offload.OffloadOptimizer \\
        optimizer.optimizer_class=torch.optim.AdamW optimizer.offload_gradients=True

Unlike torchtune's recipe, gradients are normalised by the window's token count before backward,
so clipping, accumulation and the logged grad_norm apply to the gradients the optimizer steps on.
Checkpoints to resume from are written every ``save_every_n_steps`` steps and at each epoch's end
into ``output_dir/checkpoints``; ``resume_from_checkpoint=True`` continues from the newest one.
A run stops at its first nan or inf loss or gradient norm, naming the step and the last good
checkpoint, and never saves non-finite weights (:mod:`torchtune_offload.recipe.divergence`).
"""

import sys

from omegaconf import DictConfig
from torchtune import config, training

from torchtune_offload.recipe import (
    MemoryMonitor,
    Progress,
    SavePoint,
    TrainLoop,
    TrainingCheckpoints,
    build_dataloader,
    build_loss,
    build_lr_scheduler,
    build_metric_logger,
    build_optimizer,
    build_profiler,
    check_host_memory,
    check_weights_fit_device,
    instantiate_model,
    interrupt_reported,
    load_checkpoint,
    loss_ignore_index,
    preflight,
    run_output_dir,
    save_atomically,
    use_expandable_segments,
)


class FullFinetuneRecipeSingleDevice:
    """Full fine-tuning of a decoder on one device.

    Args:
        cfg: the parsed config; every key is checked here, before anything is allocated.

    Raises:
        ValueError: listing every invalid key, value or combination of the config.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Before anything is loaded, in one error: the config's problems, a run that cannot fit host
        # memory (with figures), missing or damaged files.
        self.settings, self.host_memory = preflight(cfg, recipe="full", check_host=lambda s: check_host_memory(cfg, s))
        self.progress = Progress.start(self.settings)
        # With resume_from_checkpoint=True: the newest complete checkpoint, read in setup().
        self._checkpoints = TrainingCheckpoints(cfg, self.settings, self.progress)
        # What cleanup() closes; set by setup(), which may fail part-way.
        self._metric_logger = None
        self._memory = None
        self._optimizer = None

    def setup(self, cfg: DictConfig) -> None:
        s = self.settings
        # 1. Logging first, so that the config is recorded even if a later step fails.
        self._metric_logger = build_metric_logger(cfg)
        # Before the first device allocation: offload runs free and re-make layer-sized blocks all the time.
        allocator_note = use_expandable_segments(s.device, offloads=s.optimizer.kind.offloads)
        if allocator_note:
            print(f"[torchtune_offload] {allocator_note}")
        # 2. Data before any weight is read: a dataset that cannot load, or an epoch shorter than
        # one window, fails here, not after the weights have loaded.
        self._dataloader = build_dataloader(cfg.dataset, cfg.tokenizer, s, ignore_index=loss_ignore_index(cfg.loss))
        self.progress.measure_epoch(self._dataloader, s)
        # 3. The configured weights from the checkpointer.
        self._checkpointer, ckpt = load_checkpoint(cfg.checkpointer, s, progress=None)
        # Before the model is built on the device: weights it cannot hold fail here, by size.
        check_weights_fit_device(ckpt[training.MODEL_KEY], device=s.device, dtype=s.dtype,
                                 device_weights=s.optimizer.device_weights)
        # 4. Model (with the trained weights when resuming), then the optimizer that copies them.
        self._model = instantiate_model(cfg.model, s)
        # pop: the loaded weights are freed before the optimizer allocates its host memory.
        self._model.load_state_dict(ckpt.pop(training.MODEL_KEY))
        self._checkpoints.restore_weights(self._model, names=list(self._model.state_dict()))
        training.validate_expected_param_dtype(self._model.named_parameters(), dtype=s.dtype)
        self._optimizer = build_optimizer(
            cfg.optimizer, self._model, s, state_dict=self._checkpoints.take_optimizer_state(),
        )
        # 5. The loss (a chunked one sets the model's output chunks).
        loss_fn = build_loss(cfg.loss, self._model, s)
        # 6. Schedule, profiler and memory figures, wired into the shared loop.
        self._lr_scheduler = build_lr_scheduler(cfg.get("lr_scheduler"), optimizer=self._optimizer,
                                                progress=self.progress)
        profiler = build_profiler(cfg.get("profiler"), all_threads=s.profile_all_threads)
        self._memory = MemoryMonitor(s.device, optimizer=self._optimizer)
        self._loop = TrainLoop(
            model=self._model, loss_fn=loss_fn, dataloader=self._dataloader, optimizer=self._optimizer,
            lr_scheduler=self._lr_scheduler, profiler=profiler, metric_logger=self._metric_logger,
            memory=self._memory, settings=s, progress=self.progress, output_dir=run_output_dir(cfg),
        )
        # 7. Last, so nothing drawn during setup moves them: data position, schedule, RNGs.
        self._checkpoints.restore_position(dataloader=self._dataloader, lr_scheduler=self._lr_scheduler)

    def train(self) -> None:
        # The loop pauses where a checkpoint is due; progress says where training stands.
        for point in self._loop.run():
            if point is SavePoint.EPOCH:
                # The epoch's weights in the checkpoint's own format, for inference and export.
                save_atomically(self._checkpointer, {training.MODEL_KEY: self._model.state_dict()},
                                epoch=self.progress.epochs_run - 1, intermediate_checkpoint=False)
            if not self.progress.finished:
                # A checkpoint to resume from, mid-epoch or at the next epoch's start.
                self._checkpoints.save(
                    weights=self._model.state_dict(), optimizer_state=self._optimizer.state_dict(),
                    dataloader=self._dataloader, lr_scheduler=self._lr_scheduler,
                )

    def cleanup(self) -> None:
        if self._optimizer is not None:
            self._optimizer.close()
        if self._memory is not None:
            self._memory.close()
        if self._metric_logger is not None:
            self._metric_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run recipes/full_finetune_single_device.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
    with interrupt_reported(cfg):  # Ctrl-C: where to resume from, not a traceback
        try:
            recipe.setup(cfg=cfg)
            recipe.train()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
