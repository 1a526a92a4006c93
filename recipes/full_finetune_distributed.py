"""Full fine-tuning on several devices with FSDP2, on CUDA (NCCL) or on CPU (gloo).

Takes torchtune 0.6.1's ``full_finetune_distributed`` configs. Launch with::

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py \\
        --config configs/tiny/full_distributed.yaml device=cpu

Unlike torchtune's recipe it shards with FSDP2 at every world size (one code path, testable with one
process), picks its units from ``fsdp_shard_policy`` (see :mod:`torchtune_offload.distributed.policies`;
``[layers, embeddings]`` gives the token embedding and the output projection units of their own),
runs on a CPU device, and shares the single-device recipe's gradient math, loop, metrics and memory
figures: the logged loss is the mean over every rank's tokens, so it equals a one-process run over
the same global batch.

Checkpoints to resume from are written every ``save_every_n_steps`` steps and at each epoch's end
into ``output_dir/checkpoints`` (gathered to rank 0, with every rank's data position and RNG
states: :mod:`torchtune_offload.recipe.checkpoints.distributed_checkpoints`); ``resume_from_checkpoint=True``
continues exactly from the newest one on the same number of ranks, and with ``torchtune_offload.OffloadOptimizer``
(whose states each rank writes for its own shards) on another number of ranks too, at the same global batch, where
its base optimizer's states are element by element (:mod:`torchtune_offload.distributed.reshard`).
A run stops on every rank at its first nan or inf loss or gradient norm, naming the step and the
last good checkpoint, and never saves non-finite weights (:mod:`torchtune_offload.recipe.divergence`).

Weights are read on rank 0 only and broadcast shard by shard, so host memory holds one full copy
per node, not one per rank. Before that, every rank checks that the node's host memory holds what
its ranks will keep there (``host_memory_check``, as in the single-device recipes).
``optimizer._component_=torchtune_offload.OffloadOptimizer`` offloads each rank's optimizer states for
its own shards (:mod:`torchtune_offload.distributed.sharded_offload`; with ``offload_gradients`` and
``overlap`` as on one device). ``fsdp_cpu_offload=True`` instead keeps the sharded parameters, gradients
and optimizer state in host memory, where a plain ``torch.optim.AdamW`` then steps.
"""

import os
import time
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torchtune import config, training, utils

from torchtune_offload.distributed import (
    exit_without_finalizing,
    plan_shard,
    set_host_threads,
    shard_model,
    shard_policy_of,
)
from torchtune_offload.recipe import (
    DistributedCheckpoints,
    MemoryMonitor,
    Progress,
    SavePoint,
    TrainLoop,
    build_dataloader,
    build_loss,
    build_lr_scheduler,
    build_metric_logger,
    build_optimizer,
    build_profiler,
    check_host_memory,
    instantiate_model,
    interrupt_reported,
    load_checkpoint,
    loss_ignore_index,
    preflight,
    run_output_dir,
    save_atomically,
)

log = utils.get_logger("INFO")


def _backend(device: torch.device) -> str:
    if device.type == "cpu":
        return "gloo"
    # gloo beside the accelerator's backend serves collectives on host tensors: with
    # fsdp_cpu_offload the gradient norm of CPU shards is all-reduced on the host (torchtune #2108).
    return f"{device.type}:{dist.Backend.default_device_backend_map[device.type]},cpu:gloo"


class FullFinetuneRecipeDistributed:
    """Full fine-tuning of a decoder, sharded with FSDP2 over every rank.

    Args:
        cfg: the parsed config; every key, the shard policy and the optimizer are checked here,
            before the process group starts or any memory is allocated.

    Raises:
        ValueError: listing every invalid key, value or combination of the config, or naming a
            ``fsdp_shard_policy`` item that selects no module of the model.
    """

    def __init__(self, cfg: DictConfig) -> None:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        # Before anything is loaded or any rank starts, in one error: the config's problems, a run
        # that cannot fit this node's host memory (with figures: every rank computes the same
        # node-wide need, logged once per node), missing or damaged files and a checkpoint to resume
        # that another rank count wrote.
        self.settings, self.host_memory = preflight(
            cfg, recipe="distributed", world_size=world_size, check_host=lambda s: check_host_memory(
                cfg, s, ranks=(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))),
                log_figures=int(os.environ.get("LOCAL_RANK", 0)) == 0))
        s = self.settings
        self._policy = shard_policy_of(cfg)
        # Built on the meta device, the model costs nothing yet and the policy can be checked
        # against its module names now.
        self._model = instantiate_model(cfg.model, s, device=torch.device("meta"))
        plan_shard(self._model, self._policy)

        if "WORLD_SIZE" in os.environ:  # launched by torchrun / tune run --nproc_per_node
            dist.init_process_group(_backend(s.device))
        else:
            dist.init_process_group(_backend(s.device), store=dist.HashStore(), rank=0, world_size=1)
        self.world_size, self.rank = dist.get_world_size(), dist.get_rank()
        self._is_rank_zero = self.rank == 0
        self.progress = Progress.start(s)
        # With resume_from_checkpoint=True: the newest complete checkpoint, read in setup() by rank 0.
        self._checkpoints = DistributedCheckpoints(cfg, optimizer=s.optimizer, keep_last=s.keep_last_n_checkpoints,
                                                   resume=s.resume_from_checkpoint, rank=self.rank,
                                                   world_size=self.world_size)
        # What cleanup() closes; set by setup(), which may fail part-way.
        self._metric_logger = None
        self._memory = None
        self._trained = False

    def _log(self, msg: str) -> None:
        utils.log_rank_zero(log, msg)

    def setup(self, cfg: DictConfig) -> None:
        s = self.settings
        if s.fsdp_cpu_offload or s.device.type == "cpu":
            # The host runs the optimizer step (and on a CPU device everything): give each rank
            # its share of the cores, so together they use all of them without oversubscribing.
            self._log(f"{set_host_threads()} CPU threads per rank.")
        # 1. Logging first (rank 0), so that the config is recorded even if a later step fails.
        if self._is_rank_zero:
            self._metric_logger = build_metric_logger(cfg)
        # 2. Data before any weight is read: a dataset that cannot load, or an epoch shorter than one
        # window, fails here. Each rank reads its own part of every global batch.
        self._dataloader = build_dataloader(
            cfg.dataset, cfg.tokenizer, s, ignore_index=loss_ignore_index(cfg.loss),
            world_size=self.world_size, rank=self.rank,
        )
        # 3. The configured weights, read on rank 0 only; when resuming, rank 0 replaces them with
        # the checkpoint's trained ones and every rank gets the position and its own part.
        ckpt: Dict[str, Any] = {}
        self._checkpointer = None
        if self._is_rank_zero:
            self._checkpointer, ckpt = load_checkpoint(cfg.checkpointer, s, progress=None)
        full = ckpt.pop(training.MODEL_KEY, {})
        self.progress = self._checkpoints.restore_progress(self.progress, full)
        # 4. Shard the meta model, materialise it, and scatter rank 0's weights into the shards.
        self._shard_and_load(full)
        # 5. Optimizer over the shards; when resuming, its state (rank 0's scattered, or each rank's own file).
        self._optimizer = build_optimizer(cfg.optimizer, self._model, s)
        if s.resume_from_checkpoint:
            self._checkpoints.restore_optimizer(self._model, self._optimizer, component=s.optimizer.component)
        # 6. The loss (a chunked one sets the model's output chunks), and the steps of an epoch.
        loss_fn = build_loss(cfg.loss, self._model, s, verbose=self._is_rank_zero)
        self.progress.measure_epoch(self._dataloader, s)
        # 7. Schedule, profiler and memory figures, wired into the shared loop.
        self._lr_scheduler = build_lr_scheduler(cfg.get("lr_scheduler"), optimizer=self._optimizer,
                                                progress=self.progress)
        profiler = build_profiler(cfg.get("profiler"), all_threads=s.profile_all_threads)
        self._memory = MemoryMonitor(s.device, optimizer=self._optimizer)
        self._loop = TrainLoop(
            model=self._model, loss_fn=loss_fn, dataloader=self._dataloader, optimizer=self._optimizer,
            lr_scheduler=self._lr_scheduler, profiler=profiler, metric_logger=self._metric_logger,
            memory=self._memory, settings=s, progress=self.progress, output_dir=run_output_dir(cfg),
            is_rank_zero=self._is_rank_zero,
        )
        # 8. Last, so nothing drawn during setup moves them: data position, schedule, RNGs.
        self._checkpoints.restore_position(progress=self.progress, dataloader=self._dataloader,
                                           lr_scheduler=self._lr_scheduler)
        dist.barrier()
        self._log(
            f"Setup done: global batch {s.batch_size * s.gradient_accumulation_steps * self.world_size}."
        )

    def _shard_and_load(self, full: Dict[str, torch.Tensor]) -> None:
        """Shards the meta model over the ranks, materialises it on the device and scatters ``full``
        (rank 0's full weights; empty on the other ranks) into the shards, then empties ``full``."""
        s = self.settings
        t0 = time.perf_counter()
        mesh = init_device_mesh(s.device.type, (self.world_size,), mesh_dim_names=("dp",))
        plan = shard_model(
            self._model, policy=self._policy, cpu_offload=s.fsdp_cpu_offload,
            reshard_after_forward=s.fsdp_reshard_after_forward, mesh=mesh,
        )
        self._log(f"FSDP units: {plan.units} and the root.")
        for name, reason in plan.skipped.items():
            self._log(f"fsdp_shard_policy selects '{name}', which gets no unit of its own: {reason}.")
        with training.set_default_dtype(s.dtype), s.device:
            for m in self._model.modules():
                if hasattr(m, "rope_init"):  # RoPE caches are not in the state dict
                    m.rope_init()
        if full:
            dtypes = {k: v.dtype for k, v in self._model.state_dict().items()}
            full.update({k: v.to(dtypes.get(k, v.dtype)) for k, v in full.items()})
        with warnings.catch_warnings():
            # torch's state-dict code asks for a deprecated default device; the answer is right.
            warnings.filterwarnings("ignore", message=".*_get_pg_default_device|.*Multiple backends are registered")
            set_model_state_dict(
                self._model, full, options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True, strict=True, cpu_offload=s.fsdp_cpu_offload,
                ),
            )
        full.clear()  # setup() holds it too: rank 0's full copy goes before the optimizer is built
        training.validate_no_params_on_meta_device(self._model)
        training.validate_expected_param_dtype(self._model.named_parameters(), dtype=s.dtype)
        self._log(f"Sharded over {self.world_size} rank(s) and loaded in {time.perf_counter() - t0:.1f}s.")

    # ----------------------------------------------------------------------------- checkpoints

    def _save_epoch(self) -> None:
        """The finished epoch's weights in the checkpoint's own format, for inference and export."""
        # Every rank gathers; only rank 0 receives the full tensors and writes them.
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        ckpt = {training.MODEL_KEY: get_model_state_dict(self._model, options=options)}
        if self._is_rank_zero:
            save_atomically(self._checkpointer, ckpt, epoch=self.progress.epochs_run - 1,
                            intermediate_checkpoint=False)
        dist.barrier()

    # ------------------------------------------------------------------------------------ run

    def train(self) -> None:
        # The loop pauses where a checkpoint is due; progress says where training stands.
        for point in self._loop.run():
            if point is SavePoint.EPOCH:
                self._save_epoch()
            if not self.progress.finished:
                # A checkpoint to resume from, mid-epoch or at the next epoch's start.
                self._checkpoints.save(model=self._model, optimizer=self._optimizer, progress=self.progress,
                                       dataloader=self._dataloader, lr_scheduler=self._lr_scheduler)
        self._trained = True

    def cleanup(self) -> None:
        if self._memory is not None:
            self._memory.close()
        if self._metric_logger is not None:
            self._metric_logger.close()
        if dist.is_initialized():
            if self._trained:
                # Every rank leaves together, once the last checkpoint is written. After a failure
                # a peer may never arrive, so then each rank just leaves.
                dist.barrier()
            dist.destroy_process_group()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    """Entry point: ``tune run --nproc_per_node N recipes/full_finetune_distributed.py --config <yaml>``."""
    # torchtune logs on rank 0 only once the process group is up; it is not yet, so every rank would.
    if int(os.environ.get("RANK", 0)) == 0:
        config.log_config(recipe_name="FullFinetuneRecipeDistributed", cfg=cfg)
    recipe = FullFinetuneRecipeDistributed(cfg=cfg)
    with interrupt_reported(cfg):  # Ctrl-C: where to resume from, not a traceback
        try:
            recipe.setup(cfg=cfg)
            recipe.train()
        finally:
            recipe.cleanup()


if __name__ == "__main__":
    try:
        recipe_main()
    except SystemExit as end:  # torchtune's config.parse ends every run with sys.exit
        if end.code not in (None, 0):
            raise
    # Finished and cleaned up: leave before Python finalizes, while gloo's threads may still run
    # (torchtune_offload/distributed/rank_exit.py says why).
    exit_without_finalizing(0)
