"""LoRA fine-tuning on one device, with any optimizer, offloading or not, and exact gradient math.

Takes torchtune 0.6.1's ``lora_finetune_single_device`` configs unchanged. Swap in optimizer
offload from the command line::

    tune run recipes/lora_finetune_single_device.py --config configs/tiny/lora.yaml \\
        optimizer._component_=torchtune_offload.OffloadOptimizer optimizer.minimal_size=256

Only the adapter parameters train; the offload optimizer keeps their state on the host.
Checkpoints to resume from (the adapters and the training state) are written every
``save_every_n_steps`` steps and at each epoch's end into ``output_dir/checkpoints``;
``resume_from_checkpoint=True`` continues from the newest one.
A run stops at its first nan or inf loss or gradient norm, naming the step and the last good
checkpoint, and never saves non-finite weights (:mod:`torchtune_offload.recipe.divergence`).
"""

import sys

from omegaconf import DictConfig
from torchtune import config, training
from torchtune.modules.peft import (
    get_adapter_params,
    get_adapter_state_dict,
    get_lora_module_names,
    get_merged_lora_ckpt,
    set_trainable_params,
    validate_missing_and_unexpected_for_lora,
)

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
    check_lora_model_fits_device,
    instantiate_model,
    interrupt_reported,
    load_checkpoint,
    loss_ignore_index,
    preflight,
    run_output_dir,
    save_atomically,
    use_expandable_segments,
)


class LoRAFinetuneRecipeSingleDevice:
    """LoRA fine-tuning of a decoder on one device.

    Args:
        cfg: the parsed config; every key is checked here, before anything is allocated.

    Raises:
        ValueError: listing every invalid key, value or combination of the config.
    """

    def __init__(self, cfg: DictConfig) -> None:
        # Before anything is loaded, in one error: the config's problems, a run that cannot fit host
        # memory (with figures), missing or damaged files.
        self.settings, self.host_memory = preflight(cfg, recipe="lora", check_host=lambda s: check_host_memory(
            cfg, s, mark_trainable=lambda model: set_trainable_params(model, get_adapter_params(model))))
        self.progress = Progress.start(self.settings)
        # With resume_from_checkpoint=True: the newest complete checkpoint, read in setup().
        self._checkpoints = TrainingCheckpoints(cfg, self.settings, self.progress)
        self._lora = {
            "rank": cfg.model.lora_rank,
            "alpha": cfg.model.lora_alpha,
            "attn_modules": list(cfg.model.lora_attn_modules),
            "mlp": cfg.model.get("apply_lora_to_mlp", False),
            "output": cfg.model.get("apply_lora_to_output", False),
        }
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
        # 3. Base weights from the checkpointer, once the device is known to hold the model they go into.
        check_lora_model_fits_device(cfg.model, s)
        self._checkpointer, ckpt = load_checkpoint(cfg.checkpointer, s, progress=None)
        # 4. Model with only the adapters trainable, then the optimizer over them.
        self._model = instantiate_model(cfg.model, s)
        adapter_params = get_adapter_params(self._model)
        set_trainable_params(self._model, adapter_params)
        # pop: the loaded weights are freed before the optimizer allocates its host memory.
        base_missing, base_unexpected = self._model.load_state_dict(ckpt.pop(training.MODEL_KEY), strict=False)
        validate_missing_and_unexpected_for_lora(
            lora_attn_modules=self._lora["attn_modules"],
            apply_lora_to_mlp=self._lora["mlp"],
            apply_lora_to_output=self._lora["output"],
            base_missing=base_missing,
            base_unexpected=base_unexpected,
        )
        # Resuming: the trained adapters, which the checkpoint holds exactly.
        self._checkpoints.restore_weights(self._model, names=list(adapter_params))
        training.validate_expected_param_dtype(adapter_params.items(), dtype=s.dtype)
        self._optimizer = build_optimizer(cfg.optimizer, self._model, s,
                                          state_dict=self._checkpoints.take_optimizer_state())
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

    def _save_epoch(self, epoch: int) -> None:
        """The epoch's adapters (and merged weights) in the checkpoint's own format."""
        ckpt = {}
        state = self._model.state_dict()
        ckpt[training.ADAPTER_KEY] = get_adapter_state_dict(state)
        if not self.settings.save_adapter_weights_only:
            # get_merged_lora_ckpt adds into the base weights in place, and on a CPU device .cpu()
            # returns the parameter itself: copy, or training after this save sees the delta twice.
            merged = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
            ckpt[training.MODEL_KEY] = get_merged_lora_ckpt(merged, rank=self._lora["rank"], alpha=self._lora["alpha"])
        ckpt[training.ADAPTER_CONFIG] = {
            "r": self._lora["rank"],
            "lora_alpha": self._lora["alpha"],
            "target_modules": get_lora_module_names(self._lora["attn_modules"], self._lora["mlp"], self._lora["output"]),
            "peft_type": "LORA",
        }
        save_atomically(
            self._checkpointer, ckpt, epoch=epoch, intermediate_checkpoint=False,
            adapter_only=self.settings.save_adapter_weights_only,
        )

    def train(self) -> None:
        # The loop pauses where a checkpoint is due; progress says where training stands.
        for point in self._loop.run():
            if point is SavePoint.EPOCH:
                self._save_epoch(self.progress.epochs_run - 1)
            if not self.progress.finished:
                # A checkpoint to resume from: the adapters and the training state.
                self._checkpoints.save(
                    weights=get_adapter_state_dict(self._model.state_dict()),
                    optimizer_state=self._optimizer.state_dict(),
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
    """Entry point: ``tune run recipes/lora_finetune_single_device.py --config <yaml> [key=value ...]``."""
    config.log_config(recipe_name="LoRAFinetuneRecipeSingleDevice", cfg=cfg)
    recipe = LoRAFinetuneRecipeSingleDevice(cfg=cfg)
    with interrupt_reported(cfg):  # Ctrl-C: where to resume from, not a traceback
        try:
            recipe.setup(cfg=cfg)
            recipe.train()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
