"""``OffloadOptimizer`` on FSDP2's shards: each rank offloads the optimizer state of its own shards.

FSDP2 keeps each parameter as a DTensor sharded on dim 0; a rank's part of it (its local shard) is
a plain tensor in FSDP2's storage. :class:`ShardedOffloadOptimizer` builds this project's engine over
parameters that share that storage, so the engine's in-place updates are the DTensor's, and hands it
each local gradient shard at ``step()``. It is a plain optimizer to its caller: the gradients it
steps on are the DTensors' ``.grad``, which the caller measures and clips as FSDP2 with
``torch.optim.AdamW`` would (``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``, the
global norm in DTensor's reduction order), so a run's losses and weights are those of FSDP2 with the
same base optimizer, bit for bit, where the engine's host step is (``update_on`` host or device).

The host step runs after backward, once FSDP2 has reduce-scattered the gradients. Gradients moved to
the host during backward (``offload_gradients``) and host steps beside the next forward (``overlap``)
need the engine's backward hooks on the sharded parameters and its waits before FSDP2's all-gather;
they, and FP8 device weights (which would replace FSDP2's shards), are refused here.
"""

from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch.distributed.tensor import DTensor
from torchtune import training

from torchtune_offload.optim.capabilities import OptimizerCapabilities
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.optim.optimizer_class import DEFAULT_BASE, split_options

#: What marks a state :meth:`ShardedOffloadOptimizer.state_dict` wrote.
SHARDED_STATE_FORMAT = "torchtune_offload.ShardedOffloadOptimizer/1"
#: The engine's options that need its hooks in FSDP2's backward and forward, and why each is refused.
_NEEDS_FSDP2_HOOKS = {
    "offload_gradients": "the gradient shards reach the host after backward here, not during it",
    "overlap": "a host step beside the next forward must finish before FSDP2 all-gathers its unit",
    "device_weights": "FP8 device weights would replace the shards FSDP2 all-gathers",
}


def sharded_option_problems(opts: OffloadOptions, *, reported: Iterable[str] = ()) -> List[str]:
    """What the engine's options ``opts`` ask that it cannot do on FSDP2's shards, one line a key
    (but the keys in ``reported``, which the caller names with a reason of its own)."""
    return [f"optimizer.{key}={getattr(opts, key)} on FSDP2's shards: {why}. Remove it (~optimizer.{key})."
            for key, why in _NEEDS_FSDP2_HOOKS.items() if getattr(opts, key) not in (False, None) and key not in reported]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage a rank steps: a DTensor's local shard, else the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


class ShardedOffloadOptimizer(torch.optim.Optimizer):
    """``OffloadOptimizer`` over a rank's FSDP2 shards (see the module's docstring). A torch
    optimizer whose ``param_groups`` are the engine's, so an LR scheduler built on it sets the
    learning rate the engine steps with.

    Args:
        named_params: ``model.named_parameters()`` of a model sharded with ``fully_shard``, after
            its weights are loaded (the engine copies them to the host here).
        optimizer_class: the base optimizer, as ``OffloadOptimizer`` takes it.
        **options: ``OffloadOptimizer``'s options and the base optimizer's.

    Raises:
        ValueError: for an option this mode refuses (naming ``optimizer.<key>``), or one the
            engine refuses.
    """

    #: A class for a training loop of one's own: the recipes' checkpoints gather optimizer states
    #: through torch's state-dict API, which cannot see the engine's, so a config naming it is refused.
    capabilities = OptimizerCapabilities(
        offloads=True, named_parameters=True, runs_under_fsdp2=False, steps_in_backward=False, device_types=(),
        reasons={reason: "it steps FSDP2's shards in a training loop of your own (torchtune_offload.distributed."
                 "sharded_offload); the recipes do not take it" for reason in ("runs_under_fsdp2", "device_types",
                                                                                "steps_in_backward")})

    def __init__(self, named_params: Iterable[Tuple[str, torch.Tensor]],
                 optimizer_class: Any = DEFAULT_BASE, **options: Any) -> None:
        own, _ = split_options(OffloadOptimizer.__init__, options)
        problems = sharded_option_problems(OffloadOptions.parse(**own))
        if problems:
            raise ValueError(problems[0])
        trainable = [(name, p) for name, p in named_params if p.requires_grad]
        #: Each trainable parameter and the plain parameter sharing its local shard's storage.
        self._pairs: List[Tuple[torch.Tensor, torch.nn.Parameter]] = [
            (p, torch.nn.Parameter(_local(p).detach())) for _, p in trainable]
        self.engine = OffloadOptimizer([(name, alias) for (name, _), (_, alias) in zip(trainable, self._pairs)],
                                       optimizer_class, **options)
        super().__init__([alias for _, alias in self._pairs], dict(self.engine.defaults))
        # One set of groups and state, the engine's: a scheduler's lr is the one the engine steps with.
        self.param_groups = self.engine.param_groups
        self.state = self.engine.state

    @property
    def params(self) -> List[torch.Tensor]:
        """The sharded parameters stepped, whose ``.grad`` the caller measures and clips."""
        return [p for p, _ in self._pairs]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Steps each rank's shards on the host (or, with ``update_on="device"``, streams their
        states to the device), on the gradient shards backward left.

        Raises:
            RuntimeError: if FSDP2 moved a shard to other storage after this optimizer was built.
        """
        for param, alias in self._pairs:
            if _local(param).data_ptr() != alias.data_ptr():
                raise RuntimeError("FSDP2 moved a parameter shard to new storage after the optimizer was built "
                                   "(the model was moved or its sharded state re-created): build the optimizer "
                                   "after fully_shard and after the weights are loaded.")
            alias.grad = None if param.grad is None else _local(param.grad)
        self.engine.step()
        for _, alias in self._pairs:
            alias.grad = None  # the DTensor's gradient stays the one the caller zeroes

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the sharded parameters' gradients (and the engine's)."""
        for param, _ in self._pairs:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
        self.engine.zero_grad(set_to_none=True)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's engine state (its shards' states, keyed by parameter name) and the rank and
        rank count that wrote it."""
        world_size, rank = training.get_world_size_and_rank()
        return {"format": SHARDED_STATE_FORMAT, "engine": self.engine.state_dict(), "rank": rank,
                "world_size": world_size}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state :meth:`state_dict` wrote on the same rank of the same number of ranks.

        Raises:
            ValueError: for a state another rank, or another rank count, wrote (its shards are
                other parts of the parameters, even where their shapes agree).
        """
        world_size, rank = training.get_world_size_and_rank()
        written = (state_dict.get("rank"), state_dict.get("world_size"))
        if written != (rank, world_size):
            raise ValueError(f"This optimizer state was written by rank {written[0]} of {written[1]}, and this is "
                             f"rank {rank} of {world_size}: each rank loads its own shards' state. Load the file "
                             "this rank wrote with the same number of ranks.")
        self.engine.load_state_dict(state_dict["engine"])

    def synchronize(self) -> None:
        self.engine.synchronize()

    def memory_report(self) -> OffloadMemoryReport:
        """This rank's host and pinned bytes (the engine's report over its shards)."""
        return self.engine.memory_report()

    def close(self) -> None:
        self.engine.close()

