"""A run whose training diverged stops, and never saves what diverged.

Once a loss or a gradient norm is nan or inf, every later step trains on garbage, and a checkpoint
written then overwrites good ones (``keep_last_n_checkpoints``) with weights that cannot be used.
:class:`DivergenceGuard` is the train loop's check:

- each optimizer step's loss and gradient norm must be finite. Both are values the loop reads for
  its progress bar and log anyway: the loss is reduced over ranks, and a sharded norm is the total
  over ranks, so every rank of a distributed run stops at the same step without a collective of
  its own;
- the trainable weights must be finite right before each pause where a checkpoint is written.

Either failure raises :class:`TrainingDivergedError`, naming the step, the optimizer, the values
and the last checkpoint the run wrote (or resumed from).
"""

import math
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.distributed.tensor import DTensor

from torchtune_offload.recipe.checkpoints.step_checkpoints import checkpoint_folder
from torchtune_offload.recipe.grad_math import sum_over_ranks
from torchtune_offload.recipe.progress import Progress


class TrainingDivergedError(RuntimeError):
    """A step's loss or gradient norm, or the weights about to be saved, are nan or inf: the run stops."""


def nonfinite_parameters(model: torch.nn.Module) -> List[str]:
    """The names of ``model``'s trainable parameters that hold a nan or an inf (under FSDP2, in
    this rank's shards; for FP8 device weights, in the host masters a checkpoint saves).

    Each parameter is reduced to its minimum and maximum (a nan propagates to both, an inf shows in
    one): no temporary the size of a weight, which a device near its memory limit could not hold,
    and one synchronisation per device for all of them.
    """
    finite: Dict[torch.device, List[torch.Tensor]] = {}
    names: Dict[torch.device, List[str]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:  # an empty shard on this rank
            continue
        local = _saved_tensor(model, name, local)
        low, high = torch.aminmax(local.detach())
        finite.setdefault(local.device, []).append(torch.isfinite(low) & torch.isfinite(high))
        names.setdefault(local.device, []).append(name)
    bad = []
    for device, flags in finite.items():
        bad += [n for n, ok in zip(names[device], torch.stack(flags).tolist()) if not ok]
    return bad


def _saved_tensor(model: torch.nn.Module, name: str, local: torch.Tensor) -> torch.Tensor:
    """What a checkpoint saves for parameter ``name``: the parameter itself, or, where the device
    holds only a placeholder (``device_weights: fp8`` keeps one element, expanded), the tensor its
    module's state-dict hook gives in its place (the exact host master)."""
    if local.untyped_storage().nbytes() >= local.numel() * local.element_size():
        return local
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return module.state_dict(keep_vars=True)[leaf]


class DivergenceGuard:
    """Stops a run at its first non-finite step and keeps non-finite weights off disk.

    Args:
        optimizer_name: the run optimizer's ``name``, for the message.
        progress: where training stands (read, never written). A run that starts past step 0
            resumed from the checkpoint of that step.
        output_dir: where the run writes its checkpoints (``resume.run_output_dir``).
    """

    def __init__(self, *, optimizer_name: str, progress: Progress, output_dir: Path) -> None:
        self._optimizer_name = optimizer_name
        self._progress = progress
        self._output_dir = Path(output_dir)
        #: The global step of the newest checkpoint to resume from, and where it came from.
        self._last_step: Optional[int] = progress.global_step or None
        self._last_origin = "the checkpoint this run resumed from"
        #: The epoch whose ``epoch_<N>`` folder was written with it, if it was an epoch's end.
        self._last_epoch: Optional[int] = None

    def check_step(self, *, loss: float, grad_norm: Optional[float]) -> None:
        """Raises if the step just done (``progress.global_step``) had a non-finite loss or norm.

        Args:
            loss: the step's loss, as logged.
            grad_norm: its gradient norm before clipping, or ``None`` where the optimizer stepped
                inside backward and no norm was measured.

        Raises:
            TrainingDivergedError: naming the step, the optimizer, the values and the last
                checkpoint.
        """
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
            return
        norm = "not measured (optimizer_in_bwd)" if grad_norm is None else f"{grad_norm:.6g}"
        raise TrainingDivergedError(
            f"Training diverged at {self._where()} with optimizer {self._optimizer_name}: the loss is {loss:.6g} "
            f"and the gradient norm {norm}. The run stops here; this step is not saved. {self._last_good()}"
        )

    def check_weights(self, model: torch.nn.Module) -> None:
        """Raises if a trainable weight is nan or inf; call it before each checkpoint is written.
        Collective under ``torch.distributed``: every rank raises, or none.

        Why the weights and not the step's loss and norm: those are measured before the step's
        update, which can itself overflow (a learning rate far too large turns finite gradients
        into infinite weights), and the next step's loss, which would show it, comes after the save.

        Raises:
            TrainingDivergedError: naming the step, the optimizer, parameters that are not finite
                and the last checkpoint.
        """
        bad = nonfinite_parameters(model)
        # One rank's shards may be finite where another's are not: all stop, or the others wait in the save.
        count = int(sum_over_ranks(torch.tensor(len(bad))))
        if count == 0:
            return
        raise TrainingDivergedError(
            f"Training diverged at {self._where()} with optimizer {self._optimizer_name}: after its update "
            f"{count} trainable parameter(s) hold nan or inf ({', '.join(bad[:3]) or 'on other ranks'}"
            f"{', ...' if len(bad) > 3 else ''}), though its loss and gradient norm were finite. The run stops "
            f"without saving them. {self._last_good()}"
        )

    def saved(self) -> None:
        """The recipe wrote the checkpoint the loop paused for: the step checkpoint of
        ``progress.global_step``, and at an epoch's end that epoch's ``epoch_<N>`` folder."""
        p = self._progress
        self._last_step, self._last_origin = p.global_step, "written by this run"
        self._last_epoch = p.epochs_run - 1 if p.steps_run_in_epoch == 0 else None

    def _where(self) -> str:
        p = self._progress
        if p.steps_run_in_epoch == 0:  # checked after the epoch ended
            return f"step {p.global_step} (the end of epoch {p.epochs_run})"
        return f"step {p.global_step} (epoch {p.epochs_run + 1}, step {p.steps_run_in_epoch} of {p.steps_per_epoch})"

    def _last_good(self) -> str:
        if self._last_step is None:
            return ("No checkpoint was written before it, so there is nothing to resume: start again with a lower "
                    "optimizer.lr or with clip_grad_norm set (save_every_n_steps saves between epoch ends).")
        path = checkpoint_folder(self._output_dir, self._last_step)
        epoch = (f", and {self._output_dir / f'epoch_{self._last_epoch}'} holds that epoch's weights"
                 if self._last_epoch is not None else "")
        return (f"The last good checkpoint is {path} (step {self._last_step}, {self._last_origin}){epoch}. "
                "resume_from_checkpoint=True continues from it exactly, optimizer state and LR schedule "
                "included, so the same settings diverge the same way: set or lower clip_grad_norm before "
                "resuming, or start again with a lower optimizer.lr.")
