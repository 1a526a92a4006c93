"""Step checkpoints of the distributed (FSDP2) recipe, with the single-device recipes' contract.

The sharded weights and optimizer state are gathered to rank 0 as full state dicts (torch's
distributed state-dict API, moved to the host one tensor at a time) and rank 0 writes them with
:class:`torchtune_offload.recipe.checkpoints.step_checkpoints.StepCheckpoints`: the same folder, staging,
flush, rename and manifest written last as a single-device checkpoint. Each rank's dataloader
position and RNG states are gathered beside them (``state["ranks"][rank]``) and the manifest
records the rank count. On resume rank 0 reads the checkpoint and scatters it back into the shards;
each rank takes its own position and RNG states, so the run continues exactly. A checkpoint written
on another number of ranks, or with another batching, is refused before any weight is read
(``resume.no_checkpoint_problem``), but for the engine on FSDP2's shards with element-by-element
states and the same global batch: its per-rank states (or the single-device recipe's engine state)
are re-sharded (:mod:`torchtune_offload.distributed.reshard`), each rank's data position is
re-derived from the step (the sampler deals the global batches' samples out to the ranks in turn,
so a rank's position is the step times its own batches' samples), and rank ``r`` takes the RNG
states of old rank ``r`` modulo the old rank count.

Why gather rather than ``torch.distributed.checkpoint``'s per-rank files: one format for every
recipe, one atomic rename (a per-rank save needs every rank's files and a commit across ranks),
and the full state dicts load at any FSDP layout. The price: rank 0's host holds the full weights
and optimizer state while saving and loading, as the recipe's epoch save already does.
"""

import dataclasses
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torchtune import utils

from torchtune_offload.distributed.reshard import rank_files_problems, reshard_fix, resharded_state, shard_layouts
from torchtune_offload.recipe.checkpoints.atomic_save import fsync_tree
from torchtune_offload.recipe.checkpoints.resume import batching, run_output_dir
from torchtune_offload.recipe.checkpoints.step_checkpoints import (
    STATE_FILE,
    WEIGHTS_FILE,
    ResumePoint,
    StepCheckpoints,
    describe,
    newest_checkpoint,
    rank_staging,
    read_manifest,
    restore_rng_states,
    rng_states,
)
from torchtune_offload.recipe.chosen_optimizer import ChosenOptimizer, OptimizerKind
from torchtune_offload.recipe.progress import Progress
from torchtune_offload.recipe.run_optimizer import RunOptimizer

log = utils.get_logger("INFO")


def full_optimizer_state(model: torch.nn.Module, optimizer: RunOptimizer) -> Dict[str, Any]:
    """Every rank takes part; rank 0 gets the full (unsharded) state on the host."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    states = {key: get_optimizer_state_dict(model, opt, options=options) for key, opt in optimizer.parts().items()}
    return states[None] if None in states else states


def load_full_optimizer_state(model: torch.nn.Module, optimizer: RunOptimizer, full: Dict[str, Any], *,
                              is_rank_zero: bool) -> None:
    """Scatters rank 0's full optimizer state into every rank's shards (``full`` is read on rank 0)."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for key, opt in optimizer.parts().items():
        part = full if key is None else full.get(key, {})
        set_optimizer_state_dict(model, opt, optim_state_dict=part if is_rank_zero else {}, options=options)
        # torch broadcasts the state tensors, but other ranks keep their own hyper-parameters
        # where the checkpoint has keys they lack (a scheduler's initial_lr): send them too.
        groups = [[{k: v for k, v in g.items() if k != "params"} for g in part.get("param_groups", [])]]
        dist.broadcast_object_list(groups, src=0)
        for group, saved in zip(opt.param_groups, groups[0]):
            group.update(saved)


class DistributedCheckpoints:
    """Resumes a distributed run where it stood and saves where it stands; rank 0 reads and writes.

    Args:
        cfg: the recipe config.
        optimizer: the run's optimizer (``RecipeSettings.optimizer``), whose identity each checkpoint records.
        keep_last: ``keep_last_n_checkpoints``.
        resume: ``resume_from_checkpoint``.
        rank: this process's rank.
        world_size: ranks in the run.
    """

    def __init__(self, cfg: Any, *, optimizer: ChosenOptimizer, keep_last: int, resume: bool, rank: int,
                 world_size: int) -> None:
        self._out = run_output_dir(cfg)
        self._batching = batching(cfg)
        self._optimizer = optimizer.identity
        self._keep_last = keep_last
        self._resume = resume
        self.rank, self.world_size = rank, world_size
        self._point: Optional[ResumePoint] = None
        #: This rank's part of the checkpoint resumed from: its data position and RNG states.
        self._mine: Optional[Dict[str, Any]] = None
        #: The checkpoint resumed from, on every rank (each reads its own optimizer state there).
        self._resumed_from: Optional[Path] = None
        #: The rank count that wrote it (None: the single-device recipe).
        self._written_by: Optional[int] = None
        self._store = StepCheckpoints(self._out, keep_last=keep_last) if rank == 0 else None

    # ------------------------------------------------------------------------------- resume

    def restore_progress(self, progress: Progress, full_weights: Dict[str, torch.Tensor]) -> Progress:
        """When resuming: rank 0 loads the newest checkpoint (checked) and puts its trained weights
        into ``full_weights`` (rank 0's configured weights, replaced tensor by tensor); every rank
        gets the position and its own data position and RNG states. Collective.

        Returns:
            The run's position, the same on every rank.

        Raises:
            ValueError: if the checkpoint's files do not belong together or do not fit the model, or
                if its optimizer states, written by another rank count, cannot be re-sharded (before
                any weight is read).
        """
        if not self._resume:
            return progress
        ranks: List[Any] = [None] * self.world_size
        written_by = None
        if self.rank == 0:
            self._point = StepCheckpoints.load(newest_checkpoint(self._out))
            written_by = read_manifest(self._point.path).get("ranks")
            if written_by != self.world_size:
                # The preflight let it through (resume.no_checkpoint_problem): the engine's states,
                # to be re-sharded; every file is checked now, before any weight is read.
                problems = rank_files_problems(optimizer_files(self._point.path, written_by=written_by))
                if problems:
                    raise ValueError(f"resume_from_checkpoint=True: {self._point.path} was written by "
                                     f"{written_by or 'one'} rank(s) and its optimizer states cannot be re-sharded "
                                     f"to this run's {self.world_size}:\n  - " + "\n  - ".join(problems) +
                                     "\nTo continue, " + reshard_fix(written_by))
            progress.restore(self._point.state["progress"])
            self._store = StepCheckpoints(self._out, keep_last=self._keep_last, run_id=self._point.run_id)
            self._store.prune()  # a run killed between a save and its pruning left one too many
            self._read_weights(full_weights)
            ranks = self._positions(written_by)
        state = [dataclasses.asdict(progress), str(self._point.path) if self._point is not None else None, written_by]
        dist.broadcast_object_list(state, src=0)
        self._resumed_from, self._written_by = Path(state[1]), state[2]
        mine: List[Any] = [None]
        dist.scatter_object_list(mine, ranks if self.rank == 0 else None, src=0)
        self._mine = mine[0]
        return Progress(**state[0])

    def _positions(self, written_by: Optional[int]) -> List[Dict[str, Any]]:
        """Each rank's data position and RNG states from the checkpoint (rank 0). From another rank
        count, or the single-device recipe, the position is left to :meth:`restore_position` to
        re-derive, and rank ``r`` takes old rank ``r`` modulo the old count's RNG states (a model
        drawing random numbers in training, with dropout, then draws others than an uninterrupted
        run would)."""
        state = self._point.state
        saved = (state.pop("ranks") if written_by is not None else
                 [{"dataloader": state.pop("dataloader"), "rng": state.pop("rng")}])
        if written_by == self.world_size:
            return saved
        return [{"dataloader": None, "rng": saved[r % len(saved)]["rng"]} for r in range(self.world_size)]

    def _read_weights(self, full: Dict[str, torch.Tensor]) -> None:
        path = self._point.path / WEIGHTS_FILE
        with safe_open(path, framework="pt") as f:
            saved = set(f.keys())
            if saved != set(full):
                missing, unexpected = sorted(set(full) - saved), sorted(saved - set(full))
                raise ValueError(
                    f"resume_from_checkpoint=True: {self._point.path} does not hold this model's weights (missing "
                    f"{missing[:3]}, unexpected {unexpected[:3]}). Resume with the config that wrote it.")
            for name in list(full):
                tensor = f.get_tensor(name)
                if tensor.shape != full[name].shape:
                    raise ValueError(f"resume_from_checkpoint=True: {self._point.path}: {name} is "
                                     f"{list(tensor.shape)} there and {list(full[name].shape)} in the model.")
                full[name] = tensor  # the configured tensor is freed as its trained one arrives

    def take_optimizer_state(self) -> Dict[str, Any]:
        """Rank 0's full optimizer state to scatter (empty on other ranks; handed over once)."""
        return self._point.state.pop("optimizer") if self._point is not None else {}

    def restore_optimizer(self, model: torch.nn.Module, optimizer: RunOptimizer, *, component: str) -> None:
        """Puts the checkpoint's optimizer state back: rank 0's full state scattered into the shards,
        or, for the engine on FSDP2's shards, each rank's own file read by that rank (written by
        another rank count: this rank's state cut from every rank's files,
        :func:`~torchtune_offload.distributed.reshard.resharded_state`). Collective."""
        if optimizer.kind is OptimizerKind.SHARDED_ENGINE:
            self.take_optimizer_state()  # rank 0's record of the per-rank files, nothing to scatter
            if self._written_by == self.world_size:
                state = torch.load(self._resumed_from / rank_state_file(self.rank), map_location="cpu",
                                   weights_only=False)
            else:
                state = resharded_state(optimizer_files(self._resumed_from, written_by=self._written_by),
                                        optimizer=optimizer.optimizer, layouts=shard_layouts(model.named_parameters()),
                                        rank=self.rank, world_size=self.world_size)
            optimizer.load_state_dict(state, component=component)
            dist.barrier()
            return
        load_full_optimizer_state(model, optimizer, self.take_optimizer_state(), is_rank_zero=self.rank == 0)

    def restore_position(self, *, progress: Progress, dataloader: Any, lr_scheduler: Optional[Any]) -> None:
        """Puts this rank's data position, the LR schedule and this rank's RNG states back, last
        in setup(). Collective."""
        if self._mine is None:
            return
        if progress.steps_run_in_epoch > 0:
            # At an epoch's start the sampler's order depends on the epoch alone.
            position = self._mine["dataloader"]
            if position is None:  # written by another rank count
                position = position_after(dataloader, num_batches=progress.steps_run_in_epoch
                                          * self._batching["gradient_accumulation_steps"],
                                          batch_size=self._batching["batch_size"])
            dataloader.load_state_dict(position)
        schedule = [self._point.state.get("lr_scheduler") if self._point is not None else None]
        dist.broadcast_object_list(schedule, src=0)
        if lr_scheduler is not None and schedule[0] is not None:
            lr_scheduler.load_state_dict(schedule[0])
        restore_rng_states(self._mine["rng"])
        if self._point is not None:
            each = f" Each of the {self.world_size} ranks takes its own data position and RNG states."
            if self._written_by != self.world_size:
                each = (f" Written by {f'{self._written_by} ranks' if self._written_by else 'the single-device recipe'}"
                        f": the optimizer states are re-sharded to {self.world_size} ranks and each rank's data "
                        "position is re-derived from the step.")
                self._warn_if_epochs_differ(progress, dataloader)
            log.info(describe(self._point, steps_per_epoch=progress.steps_per_epoch) + each)
        self._point = self._mine = None

    def _warn_if_epochs_differ(self, progress: Progress, dataloader: Any) -> None:
        """Rank 0, resuming from another rank count: warns where an epoch of the run that wrote the
        checkpoint had another number of steps (the sampler pads the dataset to a multiple of the
        rank count, and a rank's batches are whole), so epochs end at other steps than there."""
        then = read_manifest(self._point.path).get("batching") or self._batching
        per_rank = -(-len(dataloader.dataset) // (self._written_by or 1))
        windows = per_rank // then["batch_size"] // then["gradient_accumulation_steps"]
        old = windows if progress.max_steps_per_epoch is None else min(windows, progress.max_steps_per_epoch)
        if old != progress.steps_per_epoch:
            log.warning(f"An epoch had {old} steps in the run that wrote {self._point.path} and has "
                        f"{progress.steps_per_epoch} here (the dataset's {len(dataloader.dataset)} samples are dealt "
                        "out to another rank count): the data order within each global batch is kept, but epochs "
                        "end at other steps than in that run.")

    # --------------------------------------------------------------------------------- save

    def save(self, *, model: torch.nn.Module, optimizer: RunOptimizer, progress: Progress, dataloader: Any,
             lr_scheduler: Optional[Any]) -> None:
        """Saves a checkpoint to continue from where ``progress`` stands. Collective: every rank
        gathers; rank 0 writes; all leave once it is in place."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(model, options=options)
        rank_files = []
        if optimizer.kind is OptimizerKind.SHARDED_ENGINE:
            # Each rank writes its own shards' state: gathered, the one host would hold every rank's.
            rank_files = self._save_rank_states(optimizer, global_step=progress.global_step)
            optimizer_state: Dict[str, Any] = {"rank_files": [p.name for p in rank_files]}
        else:
            optimizer_state = full_optimizer_state(model, optimizer)
        ranks: Optional[List[Any]] = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object({"dataloader": dataloader.state_dict(), "rng": rng_states()}, ranks, dst=0)
        if self.rank == 0:
            state = {
                "progress": progress.state(),
                "optimizer": optimizer_state,
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "ranks": ranks,
            }
            path = self._store.save(global_step=progress.global_step, epoch=progress.epochs_run,
                                    step_in_epoch=progress.steps_run_in_epoch, weights=weights, state=state,
                                    ranks=self.world_size, batching=self._batching,
                                    optimizer=self._optimizer, rank_files=rank_files)
            log.info(f"Checkpoint saved to {path}: resume_from_checkpoint=True on {self.world_size} ranks "
                     "continues from here.")
        dist.barrier()

    def _save_rank_states(self, optimizer: RunOptimizer, *, global_step: int) -> List[Path]:
        """Writes this rank's optimizer state where rank 0's save moves it from; returns every
        rank's file (the same paths on every rank). Collective: all have written when it returns."""
        folder = rank_staging(self._out, global_step)
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)  # a killed earlier attempt at this save
            folder.mkdir(parents=True)
        dist.barrier()
        path = folder / rank_state_file(self.rank)
        torch.save(optimizer.state_dict(), path)
        fsync_tree(folder)
        dist.barrier()
        return [folder / rank_state_file(rank) for rank in range(self.world_size)]


def rank_state_file(rank: int) -> str:
    """The name of one rank's optimizer state in a checkpoint of the engine on FSDP2's shards."""
    return f"optimizer_rank{rank:05d}.pt"


def optimizer_files(folder: Path, *, written_by: Optional[int]) -> List[Path]:
    """The files holding the engine's optimizer states in the checkpoint ``folder``, in rank order:
    one a rank, or (``written_by`` None: the single-device recipe) its training state."""
    if written_by is None:
        return [folder / STATE_FILE]
    return [folder / rank_state_file(rank) for rank in range(written_by)]


def position_after(dataloader: Any, *, num_batches: int, batch_size: int) -> Dict[str, Any]:
    """``dataloader``'s state after ``num_batches`` batches of ``batch_size`` of its epoch: its own
    state before any batch, with torchdata's counts of batches and of the sampler's samples set.

    Raises:
        ValueError: if the state is not torchdata's ``StatefulDataLoader`` one over a stateful sampler.
    """
    state = dict(dataloader.state_dict())
    sampler = state.get("_sampler_iter_state")
    if not isinstance(sampler, dict) or not isinstance(sampler.get("sampler_state"), dict) \
            or "yielded" not in sampler["sampler_state"]:
        raise ValueError("resume_from_checkpoint=True on another rank count: this dataloader's state "
                         f"({sorted(state)}) is not the one whose position can be re-derived; resume with the "
                         "rank count that wrote the checkpoint.")
    samples = num_batches * batch_size
    state.update(_num_yielded=num_batches, _sampler_iter_yielded=num_batches,
                 _sampler_iter_state={**sampler, "samples_yielded": samples, "sampler_state": {"yielded": samples}})
    return state
