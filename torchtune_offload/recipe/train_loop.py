"""The fine-tuning loop the recipes share.

One optimizer step is one *window* of ``gradient_accumulation_steps`` micro-batches. The window's
loss-carrying tokens are counted first, so each micro-batch's summed loss can be divided by the
window total before backward (see :mod:`torchtune_offload.recipe.grad_math`).
"""

import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torchtune import training, utils
from torchtune.training.lr_schedulers import get_lr
from tqdm import tqdm

from torchtune_offload.recipe.builders import steps_per_epoch
from torchtune_offload.recipe.config import RecipeSettings
from torchtune_offload.recipe.grad_math import GradientStepper, loss_scale, sum_over_ranks
from torchtune_offload.recipe.memory import MemoryMonitor

log = utils.get_logger("INFO")


class TrainLoop:
    """Runs epochs of windows: forward, backward with normalised loss, step, log, checkpoint.

    Args:
        model: the model being trained.
        loss_fn: torchtune loss returning the mean over non-ignored tokens.
        dataloader: batches with ``tokens`` and ``labels``; its sampler has ``set_epoch``.
        optimizer: the optimizer the loop steps, or ``None`` when it steps inside backward.
        in_bwd_wrapper: torchtune's wrapper of the per-parameter optimizers stepping in
            backward (``optimizer_in_bwd``), else ``None``.
        lr_scheduler: stepped once per window, or ``None``.
        profiler: torchtune's profiler or its no-op stand-in.
        metric_logger: torchtune metric logger.
        memory: memory figures for the log.
        settings: validated recipe settings; clipping, activation offloading and the optimizer's
            capabilities.
        is_rank_zero: only rank zero shows progress and logs.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        loss_fn: Any,
        dataloader: Any,
        optimizer: Optional[torch.optim.Optimizer],
        in_bwd_wrapper: Optional[Any],
        lr_scheduler: Optional[Any],
        profiler: Any,
        metric_logger: Any,
        memory: MemoryMonitor,
        settings: RecipeSettings,
        is_rank_zero: bool = True,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.dataloader = dataloader
        self.stepper = GradientStepper(
            optimizer=optimizer,
            params=model.parameters(),
            capabilities=settings.optimizer_capabilities,
            clip_grad_norm=settings.clip_grad_norm,
        )
        # get_lr reads torchtune's in-backward wrapper as it reads an optimizer.
        self.lr_source = optimizer if optimizer is not None else in_bwd_wrapper
        self.lr_scheduler = lr_scheduler
        self.profiler = profiler
        self.metric_logger = metric_logger
        self.memory = memory
        self.settings = settings
        self.steps_per_epoch = steps_per_epoch(dataloader, settings)
        # A no-op context unless activation offloading is on.
        self.activations_ctx = training.get_act_offloading_ctx_manager(model, settings.enable_activation_offloading)
        self.is_rank_zero = is_rank_zero
        self.ignore_index = loss_fn.ignore_index
        self.losses: List[float] = []
        if is_rank_zero:
            log.info(
                f"{self.steps_per_epoch} steps per epoch x {settings.epochs} epochs; optimizer "
                f"{type(self.lr_source).__name__}{' (offload)' if settings.optimizer_capabilities.offloads else ''}."
            )

    def _shift_labels(self, batch: Dict[str, torch.Tensor]) -> None:
        # Position t predicts token t+1; the last position has nothing to predict.
        labels = batch["labels"]
        pad = torch.full_like(labels[..., :1], self.ignore_index)
        batch["labels"] = torch.cat((labels[..., 1:], pad), dim=-1)

    def _summed_loss(self, batch: Dict[str, torch.Tensor], num_tokens: torch.Tensor) -> torch.Tensor:
        labels = batch.pop("labels")
        with self.activations_ctx:
            logits = self.model(**batch)
        if not isinstance(logits, list):
            labels = labels.reshape(-1)
            logits = logits.reshape(-1, logits.size(-1))
        # The loss is a mean over this micro-batch's tokens; times their count gives the sum.
        return self.loss_fn(logits, labels) * num_tokens

    def run(
        self,
        *,
        epochs_run: int,
        save_checkpoint: Callable[[int], None],
        steps_run_in_epoch: int = 0,
        save_step_checkpoint: Optional[Callable[[int, int, int], None]] = None,
    ) -> int:
        """Trains from epoch ``epochs_run`` to the last; returns the number of epochs run.

        Args:
            epochs_run: epochs already done.
            save_checkpoint: called with the epoch after each epoch.
            steps_run_in_epoch: optimizer steps already done in epoch ``epochs_run`` (a mid-epoch
                resume; the dataloader has been put back where they left it).
            save_step_checkpoint: called as ``(epoch, steps done in it, global step)`` every
                ``save_every_n_steps`` optimizer steps (not at an epoch's end, where
                ``save_checkpoint`` saves).
        """
        s = self.settings
        global_step = epochs_run * self.steps_per_epoch + steps_run_in_epoch
        start_epoch = epochs_run
        self.profiler.start()
        for epoch in range(start_epoch, s.epochs):
            self.dataloader.sampler.set_epoch(epoch)
            batches = iter(self.dataloader)
            first = steps_run_in_epoch if epoch == start_epoch else 0
            pbar = tqdm(total=self.steps_per_epoch, initial=first, disable=not self.is_rank_zero)
            for step_in_epoch in range(first, self.steps_per_epoch):
                t0 = time.perf_counter()
                window = [next(batches) for _ in range(s.gradient_accumulation_steps)]
                for batch in window:
                    utils.batch_to_device(batch, s.device)
                    self._shift_labels(batch)
                counts = [(b["labels"] != self.ignore_index).sum() for b in window]
                num_tokens = sum_over_ranks(sum(counts))
                scale = loss_scale(num_tokens=num_tokens)
                running = torch.zeros((), device=s.device)
                for i, (batch, count) in enumerate(zip(window, counts)):
                    loss = self._summed_loss(batch, count)
                    running += loss.detach()
                    if i == len(window) - 1:
                        # An overlapping optimizer starts host steps during this backward.
                        self.stepper.before_final_backward()
                    (loss * scale).backward()
                    del loss
                grad_norm = self.stepper.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
                global_step += 1
                # Local tokens: the rate each device achieves.
                local_tokens = int(sum(counts))
                # The logged loss is the mean over the window's tokens on all ranks, as trained.
                loss_value = sum_over_ranks(running).item() / max(int(num_tokens), 1)
                self.losses.append(loss_value)
                pbar.update(1)
                pbar.set_description(f"{epoch + 1}|{global_step}|Loss: {loss_value:.4f}")
                if global_step % s.log_every_n_steps == 0 and self.is_rank_zero:
                    seconds = time.perf_counter() - t0
                    metrics = {
                        "loss": loss_value,
                        "lr": get_lr(self.lr_source),
                        "tokens_per_second": local_tokens / seconds,
                    }
                    if grad_norm is not None:
                        metrics["grad_norm"] = float(grad_norm)
                    metrics.update(self.stepper.timings())
                    if s.log_peak_memory_stats:
                        metrics.update(self.memory.stats(reset=True))
                    self.metric_logger.log_dict(metrics, step=global_step)
                self.profiler.step()
                every = s.save_every_n_steps
                if (save_step_checkpoint is not None and every is not None and global_step % every == 0
                        and step_in_epoch + 1 < self.steps_per_epoch):
                    self.stepper.synchronize()
                    save_step_checkpoint(epoch, step_in_epoch + 1, global_step)
            pbar.close()
            epochs_run += 1
            self.stepper.synchronize()
            save_checkpoint(epoch)
        self.stepper.synchronize()
        self.profiler.stop()
        return epochs_run
