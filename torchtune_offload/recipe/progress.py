"""Where training stands, saved in checkpoints so that a run can resume.

:class:`Progress` is the one owner of the run's position: the epoch, the steps done in it, the steps
an epoch has and the global step. A resume restores it before training; the train loop advances it;
checkpoints, the LR scheduler and the logs read it.
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional

from torchtune import training, utils

from torchtune_offload.recipe.checks.config import RecipeSettings

log = utils.get_logger("INFO")
_STEPS_IN_EPOCH_KEY = "steps_run_in_epoch"


@dataclass
class Progress:
    """Where training stands; saved in checkpoints to resume at an epoch boundary or mid-epoch."""

    seed: int
    epochs_run: int
    total_epochs: int
    max_steps_per_epoch: Optional[int]
    #: Optimizer steps already done in epoch ``epochs_run`` (a mid-epoch checkpoint).
    steps_run_in_epoch: int = 0
    #: Whole accumulation windows in one epoch of the dataloader, once it is built (:meth:`measure_epoch`).
    windows_per_epoch: Optional[int] = None

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
            self.steps_run_in_epoch = ckpt.get(_STEPS_IN_EPOCH_KEY, 0)
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

    def measure_epoch(self, loader: Any, settings: RecipeSettings) -> None:
        """Counts the optimizer steps of one epoch: whole windows of ``loader``, capped by
        ``max_steps_per_epoch`` (a resumed checkpoint's, where it differs from the config's)."""
        self.windows_per_epoch = len(loader) // settings.gradient_accumulation_steps

    @property
    def steps_per_epoch(self) -> Optional[int]:
        """Optimizer steps in one epoch: its windows, capped by this run's ``max_steps_per_epoch``
        (the config's, or a resumed checkpoint's: :meth:`restore`); None before :meth:`measure_epoch`."""
        cap, windows = self.max_steps_per_epoch, self.windows_per_epoch
        return windows if cap is None or windows is None else min(windows, cap)

    @property
    def global_step(self) -> int:
        """Optimizer steps done since the run began (resumed runs included)."""
        return self.epochs_run * self.steps_per_epoch + self.steps_run_in_epoch

    @property
    def total_steps(self) -> int:
        return self.total_epochs * self.steps_per_epoch

    @property
    def finished(self) -> bool:
        """Every epoch is done: nothing is left to resume."""
        return self.epochs_run >= self.total_epochs

    def advance(self) -> None:
        """One optimizer step done (the train loop's)."""
        self.steps_run_in_epoch += 1

    def finish_epoch(self) -> None:
        """The epoch is done: the next starts at its first step (the train loop's)."""
        self.epochs_run += 1
        self.steps_run_in_epoch = 0

    def state(self) -> Dict[str, Any]:
        return {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            _STEPS_IN_EPOCH_KEY: self.steps_run_in_epoch,
        }
