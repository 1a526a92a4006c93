"""Step checkpoints in the single-device recipes: resume where a run stood, save where it stands.

With ``resume_from_checkpoint=True`` the newest complete checkpoint in ``output_dir/checkpoints``
is found without any path in the config, checked (its files must come from one save), and the run
continues from it, mid-epoch if it was saved mid-epoch: weights, optimizer state, LR schedule,
dataloader position and RNG states are put back, so the result is the one of a run that was never
interrupted. ``save_every_n_steps`` adds checkpoints between epoch ends; ``keep_last_n_checkpoints``
bounds how many stay on disk.
"""

from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import utils

from torchtune_offload.distributed.reshard import reshard_fix
from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.recipe.checkpoints.atomic_save import COMPLETE_MARKER
from torchtune_offload.recipe.checkpoints.step_checkpoints import (
    CHECKPOINTS_DIR,
    ResumePoint,
    StepCheckpoints,
    describe,
    newest_checkpoint,
    restore_rng_states,
    rng_states,
    read_manifest,
)
from torchtune_offload.recipe.checks.config import RecipeSettings
from torchtune_offload.recipe.chosen_optimizer import (
    ChosenOptimizer,
    OptimizerKind,
    describe_optimizer,
    identity_overrides,
)
from torchtune_offload.recipe.progress import Progress

log = utils.get_logger("INFO")


def run_output_dir(cfg: DictConfig) -> Path:
    """Where the run writes its checkpoints: ``checkpointer.output_dir``, else ``output_dir``."""
    return Path(str(OmegaConf.select(cfg, "checkpointer.output_dir", default=None) or cfg.get("output_dir", ".")))


def final_weights(cfg: DictConfig) -> Optional[Path]:
    """The final weights of a finished run in ``output_dir``, else None: the last epoch's folder (for
    the configured ``epochs``) complete, and written after the newest checkpoint. Resuming such a
    run would train its last steps again (its newest checkpoint is from before them).

    The order is read from the files' modification times, so a folder copied without them may be
    taken for an unfinished run.
    """
    epochs = cfg.get("epochs", 1)
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1:
        return None  # refused by the config check
    out = run_output_dir(cfg)
    last, newest = out / f"epoch_{epochs - 1}", newest_checkpoint(out)
    marker = last / COMPLETE_MARKER
    if not marker.is_file() or (newest is not None and marker.stat().st_mtime < newest.stat().st_mtime):
        return None
    return last


def weight_files(folder: Path) -> List[str]:
    """The model weight files in ``folder`` by name (safetensors first, then .bin), as
    ``checkpointer.checkpoint_files`` lists them; a LoRA run's adapter files are not the model's."""
    return [p.name for pattern in ("*.safetensors", "*.bin") for p in sorted(folder.glob(pattern))
            if not p.name.startswith("adapter")]


def batching(cfg: DictConfig) -> Dict[str, Any]:
    """The config's ``batch_size`` and ``gradient_accumulation_steps``, as a checkpoint records them.

    Args:
        cfg: the recipe config.

    Returns:
        Both values; an absent or null ``gradient_accumulation_steps`` is 1, as the config check reads it.
    """
    accum = cfg.get("gradient_accumulation_steps")
    return {"batch_size": cfg.get("batch_size"), "gradient_accumulation_steps": 1 if accum is None else accum}


def optimizer_identity(cfg: DictConfig) -> Optional[Dict[str, Optional[str]]]:
    """The optimizer a config runs, as a checkpoint records it (``ChosenOptimizer.identity``).

    Args:
        cfg: the recipe config.

    Returns:
        ``{"component": ..., "optimizer_class": ... or None}``; None where the optimizer cannot be
        described (the config check reports why).
    """
    try:
        return describe_optimizer(cfg.get("optimizer"), in_backward=False).identity
    except ValueError:
        return None


def _optimizer_problem(cfg: DictConfig, newest: Path, saved: Optional[Dict[str, Any]]) -> Optional[str]:
    configured = optimizer_identity(cfg)
    if saved is None or configured is None or saved == configured:
        return None  # not recorded (the optimizer's own load checks the state), or refused by the config check

    return (f"resume_from_checkpoint=True: {newest} was saved with {identity_overrides(saved)}, and this config has "
            f"{identity_overrides(configured)}. Its optimizer state is that optimizer's, so only the same one "
            f"continues the run: resume with {identity_overrides(saved)}, or start fresh in another output_dir.")


def _batching_problem(cfg: DictConfig, newest: Path, saved: Optional[Dict[str, Any]]) -> Optional[str]:
    configured = batching(cfg)
    if saved is None or not all(isinstance(v, int) for v in configured.values()):
        return None  # not recorded (StepCheckpoints.load warns), or refused by the config check
    differ = [key for key in configured if saved.get(key) != configured[key]]
    if not differ:
        return None
    now = ", ".join(f"{key}={configured[key]}" for key in differ)
    then = " ".join(f"{key}={saved.get(key)}" for key in differ)
    return (f"resume_from_checkpoint=True: {newest} was saved with "
            f"{', '.join(f'{k}={v}' for k, v in saved.items())}, and this config has {now}. Its data "
            "position, step count and LR schedule are counted in that run's batches, so only the same values "
            f"continue it: resume with {then}, or start fresh in another output_dir.")


def no_checkpoint_problem(cfg: DictConfig, *, world_size: Optional[int] = None) -> Optional[str]:
    """Why ``resume_from_checkpoint=True`` cannot resume, else ``None``: no complete checkpoint,
    one of a finished run, or one written with another rank count, ``batch_size``,
    ``gradient_accumulation_steps`` or optimizer (read from its manifest, before any weight). The
    engine's states on FSDP2's shards continue on another rank count (or from the single-device
    recipe's engine) where they are element by element and the global batch is the same: they are
    re-sharded (:func:`_reshard_problem`).

    Args:
        cfg: the recipe config.
        world_size: the distributed recipe's rank count; ``None`` for a single-device recipe.
    """
    out = run_output_dir(cfg)
    newest = newest_checkpoint(out)
    last = final_weights(cfg)
    go_on = ""
    if last is not None:
        # The weights torchtune wrote there (a LoRA run's merged model beside its adapter), by name:
        # the config's checkpoint_files name the files the run started from, not these.
        files = weight_files(last)
        go_on = (f" To train on from its final weights, start a new run from them: checkpointer.checkpoint_dir={last} "
                 f"checkpointer.checkpoint_files=[{','.join(files)}] with another output_dir." if files else
                 f" Its final folder, {last}, holds no full weights (an adapter only): to train on, start a new run "
                 "from the base weights with that adapter, in another output_dir.")
    if newest is None:
        where = (f"{out / CHECKPOINTS_DIR} holds no complete checkpoint" if (out / CHECKPOINTS_DIR).is_dir() else
                 f"{out} holds no {CHECKPOINTS_DIR}/ folder")
        return (f"resume_from_checkpoint=True: {where} to resume from. Start without resume_from_checkpoint (add "
                "overwrite_checkpoints=True if output_dir holds an earlier run's files), or point output_dir at the "
                f"run to resume.{go_on}")
    if last is not None:
        return (f"resume_from_checkpoint=True: the run in {out} finished ({last} holds its final weights, saved after "
                f"its newest checkpoint, {newest.name}), so nothing is left to resume.{go_on}")
    manifest = read_manifest(newest)
    saved = manifest.get("ranks")
    if saved == world_size:
        return (_batching_problem(cfg, newest, manifest.get("batching"))
                or _optimizer_problem(cfg, newest, manifest.get("optimizer")))
    engine = _engine_on_shards(cfg, manifest) if world_size is not None else None
    if engine is not None:
        return _reshard_problem(cfg, newest, manifest, engine=engine, world_size=world_size)
    if world_size is None:
        return (f"resume_from_checkpoint=True: {newest} was written by the distributed recipe on {saved} ranks. "
                f"Resume it with tune run --nproc_per_node {saved} recipes/full_finetune_distributed.py.")
    if saved is None:
        return (f"resume_from_checkpoint=True: {newest} was written by a single-device recipe, whose checkpoint "
                "holds no rank's data position. Resume it with that recipe, or start fresh in another output_dir.")
    return (f"resume_from_checkpoint=True: {newest} was written on {saved} ranks and this run has {world_size}. "
            "Each rank's data position and RNG states are in it, so only the same rank count continues the run "
            f"exactly: resume with tune run --nproc_per_node {saved} (on several nodes, {saved} ranks in all), or "
            "start fresh in another output_dir.")


def _engine_on_shards(cfg: DictConfig, manifest: Dict[str, Any]) -> Optional[ChosenOptimizer]:
    """The distributed recipe's engine on FSDP2's shards where ``cfg`` runs it and the checkpoint
    of ``manifest`` was written by the same optimizer (then its states can be re-sharded), else None."""
    try:
        chosen = describe_optimizer(cfg.get("optimizer"), in_backward=False, sharded=True)
    except ValueError:
        return None  # refused by the config check
    if chosen.kind is not OptimizerKind.SHARDED_ENGINE or manifest.get("optimizer") != chosen.identity:
        return None
    return chosen


def _reshard_problem(cfg: DictConfig, newest: Path, manifest: Dict[str, Any], *, engine: ChosenOptimizer,
                     world_size: int) -> Optional[str]:
    """Why the engine's states of ``newest``, written by another rank count (or by the single-device
    recipe), cannot continue on ``world_size`` ranks, else None (they are re-sharded:
    ``torchtune_offload.distributed.reshard``). Read from the manifest, before any weight."""
    saved = manifest.get("ranks")
    written = f"{saved} ranks" if saved is not None else "the single-device recipe"
    fix = reshard_fix(saved)
    if not capabilities_of(engine.base_class).elementwise_update:
        # The checkpoint's optimizer is this run's (its identity matched): name it from the description.
        base = f"optimizer.optimizer_class={engine.base_class.__module__}.{engine.base_class.__qualname__}"
        return (f"resume_from_checkpoint=True: {newest} holds the states of {base}, written by {written}, and this "
                f"run has {world_size}: they are not kept element by element (8-bit states are quantized in blocks "
                "of each rank's shard, and cutting the shards anew would requantize them), so they are not "
                f"re-sharded. To continue, {fix}")
    then, now = manifest.get("batching"), batching(cfg)
    if not all(isinstance(v, int) for v in now.values()):
        return None  # refused by the config check
    if then is None:
        return (f"resume_from_checkpoint=True: {newest} was written by {written} and this run has {world_size}; it "
                "does not record its batch_size and gradient_accumulation_steps, so its data position cannot be "
                f"re-derived. To continue, {fix}")
    old_global = then["batch_size"] * then["gradient_accumulation_steps"] * (saved or 1)
    new_global = now["batch_size"] * now["gradient_accumulation_steps"] * world_size
    if old_global == new_global:
        return None
    per_rank, hint = old_global // world_size, ""
    if old_global % world_size == 0:
        hint = (f" (here: gradient_accumulation_steps={per_rank // now['batch_size']})"
                if per_rank % now["batch_size"] == 0 else
                f" (here: batch_size={per_rank} gradient_accumulation_steps=1)")
    return (f"resume_from_checkpoint=True: {newest} was written by {written} with batch_size={then['batch_size']} "
            f"gradient_accumulation_steps={then['gradient_accumulation_steps']}, a global batch of {old_global} "
            f"samples; this run's is {now['batch_size']} x {now['gradient_accumulation_steps']} x {world_size} ranks = "
            f"{new_global}. Its step count, LR schedule and data position are counted in global batches, so on "
            f"another rank count only the same global batch continues it: set batch_size x "
            f"gradient_accumulation_steps x ranks = {old_global}{hint}, or {fix}")


class TrainingCheckpoints:
    """Finds the checkpoint to resume from, puts a recipe back where it stood, and saves new ones.

    Args:
        cfg: the recipe config.
        settings: its checked settings.
        progress: where training stands; takes the checkpoint's position when resuming.

    A missing checkpoint is reported before this is built, with the other file problems
    (``check_files(cfg, step_resume=True)``, which uses :func:`no_checkpoint_problem`).
    """

    def __init__(self, cfg: DictConfig, settings: RecipeSettings, progress: Progress) -> None:
        self._out = run_output_dir(cfg)
        self._settings = settings
        self._batching = batching(cfg)
        self._optimizer = settings.optimizer.identity
        self.progress = progress
        self.point: Optional[ResumePoint] = None
        self.store = StepCheckpoints(self._out, keep_last=settings.keep_last_n_checkpoints)

    def restore_weights(self, model: torch.nn.Module, *, names: List[str]) -> None:
        """When resuming: loads the newest checkpoint (checked), takes its position into ``progress``
        and puts its trained weights back. Call it once the configured weights are loaded and freed
        (the training state, optimizer state included, is held from here until the optimizer takes it).

        Raises:
            ValueError: if the checkpoint's files do not belong together, or do not fit the model.
        """
        if not self._settings.resume_from_checkpoint:
            return
        self.point = StepCheckpoints.load(newest_checkpoint(self._out))
        self.progress.restore(self.point.state["progress"])
        # This run continues the resumed one: its later saves replace that run's checkpoints in turn.
        self.store = StepCheckpoints(self._out, keep_last=self._settings.keep_last_n_checkpoints,
                                     run_id=self.point.run_id)
        # A run killed between a save and its pruning may have left one checkpoint too many.
        self.store.prune()
        self.point.load_weights_into(model, names=names)

    def take_optimizer_state(self) -> Optional[Dict[str, Any]]:
        """The optimizer state to load when resuming (handed over once, then no longer held)."""
        return self.point.state.pop("optimizer") if self.point is not None else None

    def restore_position(self, *, dataloader: Any, lr_scheduler: Optional[Any]) -> None:
        """Puts the data position, the LR schedule and the RNG states back, last in setup()."""
        if self.point is None:
            return
        state = self.point.state
        if self.point.step_in_epoch > 0:
            # At an epoch's start the sampler's order depends on the epoch alone.
            dataloader.load_state_dict(state["dataloader"])
        if lr_scheduler is not None and state.get("lr_scheduler") is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
        restore_rng_states(state["rng"])
        log.info(describe(self.point, steps_per_epoch=self.progress.steps_per_epoch))
        self.point = None  # nothing of it is needed any more

    def save(
        self,
        *,
        weights: Dict[str, torch.Tensor],
        optimizer_state: Dict[str, Any],
        dataloader: Any,
        lr_scheduler: Optional[Any],
    ) -> Path:
        """Saves a checkpoint to continue from where ``progress`` stands."""
        p = self.progress
        state = {
            "progress": self.progress.state(),
            "optimizer": optimizer_state,
            "dataloader": dataloader.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "rng": rng_states(),
        }
        path = self.store.save(global_step=p.global_step, epoch=p.epochs_run, step_in_epoch=p.steps_run_in_epoch,
                               weights=weights, state=state, batching=self._batching,
                               optimizer=self._optimizer)
        log.info(f"Checkpoint saved to {path}: resume_from_checkpoint=True continues from here.")
        return path
