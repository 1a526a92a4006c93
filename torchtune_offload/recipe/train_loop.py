"""The fine-tuning loop the recipes share.

One optimizer step is one *window* of ``gradient_accumulation_steps`` micro-batches. The window's
loss-carrying tokens are counted first, so each micro-batch's summed loss can be divided by the
window total before backward (see :mod:`torchtune_offload.recipe.grad_math`).
"""

import contextlib
import enum
import gc
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.profiler import ProfilerAction
from torchtune import training, utils
from torchtune.training.lr_schedulers import get_lr
from torchtune.training.metric_logging import DiskLogger
from tqdm import tqdm

from torchtune_offload.recipe.checks.config import RecipeSettings
from torchtune_offload.recipe.divergence import DivergenceGuard
from torchtune_offload.recipe.grad_math import loss_scale, sum_over_ranks
from torchtune_offload.recipe.progress import Progress
from torchtune_offload.recipe.reports.memory import MemoryMonitor
from torchtune_offload.recipe.reports.run_report import run_summary, summarise_in_wandb
from torchtune_offload.recipe.run_optimizer import RunOptimizer

log = utils.get_logger("INFO")


def loss_of_logits(loss_fn: torch.nn.Module, logits: Any, labels: torch.Tensor) -> torch.Tensor:
    """``loss_fn`` of a micro-batch's logits: whole logits flattened with their labels, a chunked
    loss's list of chunks as the model returns it.

    Args:
        loss_fn: the recipe's loss (from :func:`build_loss`).
        logits: the model's output, a tensor or a list of chunks.
        labels: the (shifted) labels, one per token.
    """
    if not isinstance(logits, list):
        labels = labels.reshape(-1)
        logits = logits.reshape(-1, logits.size(-1))
    return loss_fn(logits, labels)


class SavePoint(enum.Enum):
    """Where the loop pauses for the recipe to save (``progress`` says where training stands)."""

    #: ``save_every_n_steps`` steps done, inside an epoch.
    STEP = "step"
    #: An epoch done.
    EPOCH = "epoch"


@contextlib.contextmanager
def _lines_beside(pbar: tqdm) -> Iterator[None]:
    """What is printed meanwhile (a save's lines) on lines of its own, after the bar is drawn at the
    step it stands at (a fast step is not drawn: tqdm draws at most every 0.1 s), and the bar drawn
    again below them. Without tqdm's lock: a save does not touch the bar, and holding the lock
    through one would stall any other thread's bar."""
    if pbar.disable:
        yield
        return
    pbar.refresh()
    with tqdm.external_write_mode(file=pbar.fp, nolock=True):
        yield


class TrainLoop:
    """Runs epochs of windows: forward, backward with normalised loss, step, log; pauses where a
    checkpoint is due. Stops with :class:`~torchtune_offload.recipe.divergence.TrainingDivergedError`
    at the first step whose loss or gradient norm is not finite, and before a pause where the
    weights are not (:class:`~torchtune_offload.recipe.divergence.DivergenceGuard`).

    Args:
        model: the model being trained.
        loss_fn: torchtune loss returning the mean over non-ignored tokens.
        dataloader: batches with ``tokens`` and ``labels``; its sampler has ``set_epoch``.
        optimizer: the run's optimizer, whatever its kind.
        lr_scheduler: stepped once per window, or ``None``.
        profiler: torchtune's profiler or its no-op stand-in.
        metric_logger: torchtune metric logger.
        memory: memory figures for the log.
        settings: validated recipe settings.
        progress: where training stands (restored when resuming, its epoch measured); the loop
            advances it.
        output_dir: where the recipe writes its checkpoints, named when the run diverges.
        is_rank_zero: only rank zero shows progress and logs.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        loss_fn: Any,
        dataloader: Any,
        optimizer: RunOptimizer,
        lr_scheduler: Optional[Any],
        profiler: Any,
        metric_logger: Any,
        memory: MemoryMonitor,
        settings: RecipeSettings,
        progress: Progress,
        output_dir: Path,
        is_rank_zero: bool = True,
    ) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.dataloader = dataloader
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.profiler = profiler
        self.metric_logger = metric_logger
        self.memory = memory
        self.settings = settings
        self.progress = progress
        # A no-op context unless activation offloading is on.
        self.activations_ctx = training.get_act_offloading_ctx_manager(model, settings.enable_activation_offloading)
        self.is_rank_zero = is_rank_zero
        self.ignore_index = loss_fn.ignore_index
        self.losses: List[float] = []
        #: What each logged step logged (rank zero), for the summary at the run's end.
        self.logged: List[Dict[str, float]] = []
        self._guard = DivergenceGuard(optimizer_name=optimizer.name, progress=progress, output_dir=output_dir)
        if is_rank_zero:
            log.info(
                f"{progress.steps_per_epoch} steps per epoch x {settings.epochs} "
                f"{'epoch' if settings.epochs == 1 else 'epochs'}; optimizer {optimizer.name}."
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
        # The loss is a mean over this micro-batch's tokens; times their count gives the sum.
        return loss_of_logits(self.loss_fn, logits, labels) * num_tokens

    def _window(self, batches: Iterator[Dict[str, torch.Tensor]]) -> Tuple[float, int, Optional[torch.Tensor]]:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches.

        Returns:
            the window's mean loss over all ranks' tokens, this rank's token count, and the
            gradient norm before clipping (None where the optimizer stepped in backward).
        """
        s = self.settings
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
                self.optimizer.before_final_backward()
            (loss * scale).backward()
            del loss
        grad_norm = self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        # The logged loss is the mean over the window's tokens on all ranks, as trained.
        loss_value = sum_over_ranks(running).item() / max(int(num_tokens), 1)
        return loss_value, int(sum(counts)), grad_norm

    def _log(self, *, loss: float, local_tokens: int, seconds: float, grad_norm: Optional[float]) -> None:
        metrics = {
            "loss": loss,
            "lr": get_lr(self.optimizer.optimizer),
            # Local tokens: the rate each device achieves.
            "tokens_per_second": local_tokens / seconds,
        }
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        if getattr(self.profiler, "current_action", ProfilerAction.NONE) != ProfilerAction.NONE:
            # The profiler warmed up or recorded this step, which slows it: medians leave it out.
            metrics["profiled"] = 1.0
        metrics.update(self.optimizer.timings())
        if self.settings.log_peak_memory_stats:
            metrics.update(self.memory.stats(reset=True))
        self.metric_logger.log_dict(metrics, step=self.progress.global_step)
        self.logged.append(metrics)

    def run(self) -> Iterator[SavePoint]:
        """Trains from where ``progress`` stands to the last epoch, pausing (yielding) where a
        checkpoint is due: every ``save_every_n_steps`` steps inside an epoch, and at each epoch's
        end. Host work is finished before each pause, so the weights and states can be read.

        Raises:
            TrainingDivergedError: at the first step whose loss or gradient norm is nan or inf (after
                logging it), or before a pause where a trainable weight is.
        """
        # What setup made (the model, the optimizer's tables, the data, every module imported) lives
        # all run. Frozen, it is left out of Python's full collections, which otherwise walk all of
        # it again every few steps (0.21 s each on the narrowed 8B on a 2-core AMD EPYC, about one in 12
        # steps; 2.2 ms at most frozen, timed with gc.callbacks). However the loop ends, it goes
        # back to the collector.
        gc.collect()
        gc.freeze()
        try:
            yield from self._epochs()
        finally:
            gc.unfreeze()

    def _epochs(self) -> Iterator[SavePoint]:
        """:meth:`run`'s epochs."""
        s, p = self.settings, self.progress
        self.profiler.start()
        while not p.finished:
            self.dataloader.sampler.set_epoch(p.epochs_run)
            batches = iter(self.dataloader)
            pbar = tqdm(total=p.steps_per_epoch, initial=p.steps_run_in_epoch, disable=not self.is_rank_zero)
            try:
                while p.steps_run_in_epoch < p.steps_per_epoch:
                    t0 = time.perf_counter()
                    loss, local_tokens, norm = self._window(batches)
                    p.advance()
                    # Read once per step, after the loss's own read has waited for the step's device work.
                    grad_norm = None if norm is None else float(norm)
                    self.losses.append(loss)
                    # Described before the count moves: update() draws the bar, which would show the new
                    # count beside the previous step's loss (and keep that line in a log).
                    pbar.set_description(f"{p.epochs_run + 1}|{p.global_step}|Loss: {loss:.4f}", refresh=False)
                    pbar.update(1)
                    if p.global_step % s.log_every_n_steps == 0 and self.is_rank_zero:
                        self._log(loss=loss, local_tokens=local_tokens, seconds=time.perf_counter() - t0,
                                  grad_norm=grad_norm)
                    self.profiler.step()
                    self._guard.check_step(loss=loss, grad_norm=grad_norm)
                    every = s.save_every_n_steps
                    if every is not None and p.global_step % every == 0 and p.steps_run_in_epoch < p.steps_per_epoch:
                        self.optimizer.synchronize()
                        self._guard.check_weights(self.model)
                        with _lines_beside(pbar):
                            yield SavePoint.STEP
                        self._guard.saved()
            finally:
                # Also when a step raises (Ctrl-C, divergence): a bar left open is drawn again at exit,
                # below the run's last message.
                pbar.close()
            p.finish_epoch()
            self.optimizer.synchronize()
            self._guard.check_weights(self.model)
            yield SavePoint.EPOCH
            self._guard.saved()
        self.optimizer.synchronize()
        self.profiler.stop()
        if self.is_rank_zero:
            log.info(run_summary(self.logged, disk_log=isinstance(self.metric_logger, DiskLogger)))
            summarise_in_wandb(self.metric_logger, self.logged)
