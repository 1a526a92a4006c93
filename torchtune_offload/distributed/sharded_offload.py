"""``OffloadOptimizer`` on FSDP2's shards: each rank offloads the optimizer state of its own shards.

FSDP2 keeps each parameter as a DTensor sharded on dim 0; a rank's part of it (its local shard) is
a plain tensor in FSDP2's storage. :class:`ShardedOffloadOptimizer` builds this project's engine over
parameters that share that storage, so the engine's in-place updates are the DTensor's, and hands it
each local gradient shard at ``step()``. It is a plain optimizer to its caller: the gradients it
steps on are the DTensors' ``.grad``, which the caller measures and clips as FSDP2 with
``torch.optim.AdamW`` would (``torch.nn.utils.get_total_norm`` and ``clip_grads_with_norm_``, the
global norm in DTensor's reduction order), so a run's losses and weights are those of FSDP2 with the
same base optimizer, bit for bit, where the engine's host step is (``update_on`` host or device).

Without ``offload_gradients`` or ``overlap`` the host step runs after backward, once FSDP2 has
reduce-scattered the gradients. With them the engine takes each gradient shard as FSDP2 hands it
over: FSDP2 calls the post-accumulate-grad hooks of its sharded parameters after each unit's
reduce-scatter (on a GPU, on its reduce-scatter stream, which the engine's copies then follow), and
this class's hook gives the engine the local shard, so a unit's gradients reach the host during
backward and, with ``overlap``, their host steps run beside the next forward. The gradients are
then the engine's: it measures and clips them, and their total norm is reduced across ranks as
DTensor reduces FSDP2's (:meth:`ShardedOffloadOptimizer.clip_grad_norm_`). With ``overlap`` each
FSDP2 unit waits for its shards' steps before FSDP2 all-gathers it (and before the units it
prefetches there): the wait is a forward pre-hook put before FSDP2's own
(:meth:`ShardedOffloadOptimizer.register_forward_waits`). FP8 device weights, which would replace
the shards FSDP2 all-gathers, are refused.
"""

import functools
from typing import Any, Dict, Iterable, List, Sequence, Tuple, Union

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtune import training

from torchtune_offload.optim.capabilities import OptimizerCapabilities
from torchtune_offload.optim.grad_norm import check_finite, combine_norms
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.optim.optimizer_class import DEFAULT_BASE, split_options

#: What marks a state :meth:`ShardedOffloadOptimizer.state_dict` wrote.
SHARDED_STATE_FORMAT = "torchtune_offload.ShardedOffloadOptimizer/1"
#: The engine's options it cannot take on FSDP2's shards, and why.
_REFUSED_ON_SHARDS = {
    "device_weights": (None, "FP8 device weights would replace the shards FSDP2 all-gathers"),
    "handoff": ("group", "a unit's gradient shards arrive together, after its reduce-scatter, so handing them over "
                "one by one frees none sooner"),
}


def sharded_option_problems(opts: OffloadOptions, *, reported: Iterable[str] = ()) -> List[str]:
    """What the engine's options ``opts`` ask that it cannot do on FSDP2's shards, one line a key
    (but the keys in ``reported``, which the caller names with a reason of its own)."""
    return [f"optimizer.{key}={getattr(opts, key)} on FSDP2's shards: {why}. Remove it (~optimizer.{key})."
            for key, (default, why) in _REFUSED_ON_SHARDS.items()
            if getattr(opts, key) != default and key not in reported]


def _local(param: torch.Tensor) -> torch.Tensor:
    """The storage a rank steps: a DTensor's local shard, else the tensor itself."""
    return param.to_local() if isinstance(param, DTensor) else param


class ShardedOffloadOptimizer(torch.optim.Optimizer):
    """``OffloadOptimizer`` over a rank's FSDP2 shards (see the module's docstring). A torch
    optimizer whose ``param_groups`` are the engine's, so an LR scheduler built on it sets the
    learning rate the engine steps with.

    Example (each rank; the distributed recipe does this with ``optimizer._component_=
    torchtune_offload.OffloadOptimizer``)::

        opt = ShardedOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-5,
                                      offload_gradients=True, overlap=True)
        opt.register_forward_waits(model)  # with overlap: each unit waits before FSDP2 gathers it
        for micro_batch in window[:-1]:
            loss_of(micro_batch).backward()
        opt.expect_final_backward(clipping=True)
        loss_of(window[-1]).backward()
        opt.clip_grad_norm_(1.0)  # over every rank
        opt.step()
        opt.zero_grad()

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
        self._hooks = []
        if self.engine.options.hands_off_in_backward:
            # FSDP2 calls these on its sharded parameters after each unit's reduce-scatter.
            self._hooks = [param.register_post_accumulate_grad_hook(functools.partial(self._take_gradient, alias))
                           for param, alias in self._pairs]
        self.engine.reduce_norms_with(self._reduce_over_ranks)
        #: The sharded parameters, and the placements of a per-tensor norm of a shard by norm type.
        self._sharded = [p for p, _ in self._pairs if isinstance(p, DTensor)]
        self._norm_placements: Dict[float, Any] = {}

    # The engine's base optimizer and options, as the recipes' log names them.
    base_class = property(lambda self: self.engine.base_class)
    options = property(lambda self: self.engine.options)

    @property
    def params(self) -> List[torch.Tensor]:
        """The sharded parameters stepped, whose ``.grad`` the caller measures and clips."""
        return [p for p, _ in self._pairs]

    @torch.no_grad()
    def _take_gradient(self, alias: torch.nn.Parameter, param: torch.Tensor) -> None:
        """FSDP2's post-accumulate-grad hook on a sharded parameter: its local gradient shard becomes
        the engine's (added to the shard the engine holds from an earlier micro-batch, as FSDP2 would
        add it), and the parameter's ``.grad`` goes, so that FSDP2 does not add into it again."""
        grad, param.grad = param.grad, None
        if grad is None:
            return
        if alias.grad is None:
            alias.grad = _local(grad)
        else:
            alias.grad.add_(_local(grad))
        self.engine.on_gradient(alias)

    def _reduce_over_ranks(self, norms: Sequence[torch.Tensor], *, norm_type: Union[float, str] = 2.0,
                           device: Union[str, torch.device], error_if_nonfinite: bool = False) -> torch.Tensor:
        """The total norm of every rank's shards from this rank's per-shard norms, reduced as
        ``torch.nn.utils.get_total_norm`` reduces FSDP2's DTensor gradients (each shard's norm a
        partial DTensor norm, then the norm of their stack), so clipping keeps FSDP2's bits."""
        if not self._sharded or not norms:
            return combine_norms(norms, norm_type=norm_type, device=device, error_if_nonfinite=error_if_nonfinite)
        order = float(norm_type)
        if order not in self._norm_placements:
            smallest = min(self._sharded, key=lambda p: p.numel())
            self._norm_placements[order] = torch._foreach_norm([smallest.detach()], order)[0].placements
        mesh, placements = self._sharded[0].device_mesh, self._norm_placements[order]
        total = combine_norms([DTensor.from_local(n.to(device), mesh, placements, run_check=False) for n in norms],
                              norm_type=order, device=device).full_tensor()
        if error_if_nonfinite:
            check_finite(total, norm_type=order)
        return total

    def _lend_gradients(self) -> None:
        """Without the backward hand-off, points each alias's ``.grad`` at its shard's local gradient,
        which backward left on the DTensor: the engine measures, clips and steps those."""
        if not self.engine.options.hands_off_in_backward:
            for param, alias in self._pairs:
                alias.grad = None if param.grad is None else _local(param.grad)

    @torch.no_grad()
    def grad_norm(self, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
        """The total norm over every rank of the gradients the next step uses (a plain tensor)."""
        self._lend_gradients()
        return self.engine.grad_norm(norm_type)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: Union[float, str] = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients the next step uses by their total norm over every rank, as FSDP2 with
        torch's AdamW clips them (``get_total_norm`` and ``clip_grads_with_norm_``); returns that
        norm before clipping (a plain tensor)."""
        self._lend_gradients()
        return self.engine.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def expect_final_backward(self, *, clipping: bool) -> None:
        """``OffloadOptimizer.expect_final_backward``: the next backward ends the window."""
        self.engine.expect_final_backward(clipping=clipping)

    def register_forward_waits(self, model: torch.nn.Module) -> None:
        """Binds the engine to ``model``'s FSDP2 units: backward hands each unit's gradient shards over
        together (they arrive together, after its reduce-scatter), and with ``overlap`` each unit waits
        for its shards' host steps (and those of the units FSDP2 prefetches from it) before FSDP2's
        pre-forward hook all-gathers them.

        Raises:
            ValueError: if ``model`` has no FSDP2 unit (``fully_shard``) over these parameters.
        """
        alias_of = {id(param): alias for param, alias in self._pairs}
        units = [(module, [alias_of[id(p)] for p in own if id(p) in alias_of],
                  [alias_of[id(p)] for p in prefetched if id(p) in alias_of])
                 for module, own, prefetched in _fsdp_units(model)]
        if self._pairs and any(isinstance(p, DTensor) for p, _ in self._pairs) and not any(o for _, o, _ in units):
            raise ValueError("ShardedOffloadOptimizer.register_forward_waits: the model has no FSDP2 unit holding "
                             "this optimizer's parameters; call it with the model sharded by fully_shard.")
        self.engine.group_handoff([own for _, own, _ in units if own])
        self.engine.register_forward_waits(model, units=[(m, own + prefetched) for m, own, prefetched in units])

    def step_timings(self) -> Dict[str, float]:
        """The engine's ``step_timings()``."""
        return self.engine.step_timings()

    def handoff_count(self) -> int:
        """The engine's ``handoff_count()``: groups of gradient shards taken from backward."""
        return self.engine.handoff_count()

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        """Steps each rank's shards on the host (or, with ``update_on="device"``, streams their
        states to the device), on the gradient shards the engine took in backward or, without its
        backward hand-off, on those backward left.

        Raises:
            RuntimeError: if FSDP2 moved a shard to other storage after this optimizer was built.
        """
        for param, alias in self._pairs:
            if _local(param).data_ptr() != alias.data_ptr():
                raise RuntimeError("FSDP2 moved a parameter shard to new storage after the optimizer was built "
                                   "(the model was moved or its sharded state re-created): build the optimizer "
                                   "after fully_shard and after the weights are loaded.")
        self._lend_gradients()
        self.engine.step()
        if not self.engine.options.hands_off_in_backward:
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
        """Loads a state :meth:`state_dict` wrote on the same rank of the same number of ranks, or
        one ``torchtune_offload.distributed.reshard.resharded_state`` cut for this rank from every
        rank's files of another rank count.

        Raises:
            ValueError: for a state another rank, or another rank count, wrote (its shards are
                other parts of the parameters, even where their shapes agree).
        """
        world_size, rank = training.get_world_size_and_rank()
        written = (state_dict.get("rank"), state_dict.get("world_size"))
        if written != (rank, world_size):
            raise ValueError(f"This optimizer state was written by rank {written[0]} of {written[1]}, and this is "
                             f"rank {rank} of {world_size}: each rank loads its own shards' state. Load the file "
                             "this rank wrote with the same number of ranks, or cut this rank's state from every "
                             "rank's file (torchtune_offload.distributed.reshard.resharded_state).")
        self.engine.load_state_dict(state_dict["engine"])

    def synchronize(self) -> None:
        self.engine.synchronize()

    def memory_report(self) -> OffloadMemoryReport:
        """This rank's host and pinned bytes (the engine's report over its shards)."""
        return self.engine.memory_report()

    def close(self) -> None:
        """Removes the backward hooks and closes the engine (``OffloadOptimizer.close``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.engine.close()


def _fsdp_units(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, List[torch.Tensor], List[torch.Tensor]]]:
    """Each FSDP2 unit of ``model`` (a ``fully_shard`` module), in ``model.modules()`` order, with the
    parameters its pre-forward hook all-gathers: its own (those of no unit inside it), and those of
    the units it prefetches (``set_modules_to_forward_prefetch``, held in FSDP2's private state)."""
    owned = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            inner = {id(p) for sub in module.modules() if sub is not module and isinstance(sub, FSDPModule)
                     for p in sub.parameters()}
            owned[module] = [p for p in module.parameters() if id(p) not in inner]
    units = []
    for module, params in owned.items():
        prefetched = [p for state in getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", [])
                      for target in state._modules for p in owned.get(target, [])]
        units.append((module, params, prefetched))
    return units

