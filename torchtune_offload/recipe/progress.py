"""Where training stands, saved in checkpoints so that a run can resume."""

from dataclasses import dataclass
from typing import Any, Dict, Optional

from torchtune import training, utils

from torchtune_offload.recipe.config import RecipeSettings

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

    def state(self) -> Dict[str, Any]:
        return {
            training.SEED_KEY: self.seed,
            training.EPOCHS_KEY: self.epochs_run,
            training.TOTAL_EPOCHS_KEY: self.total_epochs,
            training.MAX_STEPS_KEY: self.max_steps_per_epoch,
            _STEPS_IN_EPOCH_KEY: self.steps_run_in_epoch,
        }
