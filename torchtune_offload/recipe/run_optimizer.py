"""One optimizer interface for the recipes and the train loop, whatever the optimizer is.

A plain optimizer (torch, bitsandbytes), torchao's offloader (which steps on its own copies of the
gradients), this project's :class:`~torchtune_offload.OffloadOptimizer` (which also clips them and
may overlap its host step) and torchtune's per-parameter optimizers stepping inside backward
(``optimizer_in_bwd``) answer the same calls here. What differs is decided once, when
:func:`torchtune_offload.recipe.builders.build_optimizer` picks the adapter by the chosen
optimizer's kind (``recipe/chosen_optimizer.py``); the loop and the recipes never ask which kind
they hold. Capabilities (``optim/capabilities.py``) stay what the config check explains its
refusals with.
"""

from typing import Any, Dict, Iterable, Optional

import torch
from torch.distributed.tensor import DTensor

from torchtune_offload.optim.grad_norm import clip_, total_norm
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.recipe.chosen_optimizer import OptimizerKind


class RunOptimizer:
    """A plain optimizer as the loop uses it: clip (or measure) the ``.grad`` tensors, step, zero.

    Subclasses change what a kind of optimizer does differently; the defaults here do nothing
    where a plain optimizer has nothing to do (no host work to wait for, no timings).

    Args:
        optimizer: the optimizer.
        params: the trainable parameters (their ``.grad`` is clipped).
        clip_grad_norm: the largest total norm, or None to measure without clipping.
        kind: what its checkpoints are checked against on resume.
    """

    def __init__(self, optimizer: Any, *, params: Iterable[torch.Tensor], clip_grad_norm: Optional[float],
                 kind: OptimizerKind) -> None:
        self.optimizer = optimizer
        self.kind = kind
        self._params = [p for p in params if p.requires_grad]
        self._clip = clip_grad_norm

    @property
    def name(self) -> str:
        """The optimizer's class, marked where it offloads (for the log)."""
        return type(self.optimizer).__name__ + (" (offload)" if self.kind.offloads else "")

    @property
    def scheduled(self) -> torch.optim.Optimizer:
        """The optimizer an LR scheduler is built on."""
        return self.optimizer

    def attach_lr_scheduler(self, scheduler: Any) -> None:
        """Hands the LR scheduler to optimizers that need it (none here)."""

    def parts(self) -> Dict[Optional[str], torch.optim.Optimizer]:
        """The optimizers whose states make the checkpoint: ``{None: optimizer}``, or one per name."""
        return {None: self.optimizer}

    def before_final_backward(self) -> None:
        """The next backward ends the accumulation window (an overlapping optimizer starts then)."""

    def step(self) -> Optional[torch.Tensor]:
        """Clips (or measures), steps and zeroes; returns the total norm before clipping."""
        norm = self._norm_and_clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def synchronize(self) -> None:
        """Waits for host work still running (before saves and at the end)."""

    def timings(self) -> Dict[str, float]:
        """The optimizer's own figures for its last step, for the log."""
        return {}

    def memory_report(self) -> Optional[OffloadMemoryReport]:
        """Host and pinned bytes, for optimizers that offload; None for the others."""
        report = getattr(self.optimizer, "memory_report", None)
        return report() if report is not None else None

    def state_dict(self) -> Dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any], *, component: str) -> None:
        """Loads a checkpointed state after checking that this kind of optimizer wrote it.

        Raises:
            ValueError: naming the kind that wrote it and how to go on.
        """
        saved = OptimizerKind.of_state(state_dict)
        found = ("a plain optimizer (torch.optim or bitsandbytes)" if saved is OptimizerKind.PLAIN else
                 saved.value if saved is not None else
                 f"something that is not an optimizer state ({type(state_dict).__name__})")
        if saved is self.kind.layout is OptimizerKind.PLAIN:
            # Plain optimizers of different classes differ in their options (AdamW's betas, SGD's
            # momentum). initial_lr is an LR scheduler's bookkeeping, added once one is built.
            ignored = {"params", "initial_lr"}
            theirs = set(state_dict["param_groups"][0]) - ignored if state_dict["param_groups"] else set()
            mine = set(self.optimizer.param_groups[0]) - ignored
            if theirs != mine:
                saved, found = None, f"a plain optimizer with the options {sorted(theirs)}, not {sorted(mine)}"
        if saved is not self.kind.layout:
            raise ValueError(
                f"resume_from_checkpoint=True: the checkpoint's optimizer state was written by {found}, and this "
                f"run's optimizer is {self.kind.value} (optimizer._component_={component}, "
                f"optimizer_in_bwd={self.kind is OptimizerKind.IN_BACKWARD}). Resume with the optimizer settings "
                "that wrote it, or start fresh from the saved weights with resume_from_checkpoint=False."
            )
        self.optimizer.load_state_dict(state_dict)

    def close(self) -> None:
        """Stops what the optimizer runs beside training (cleanup)."""

    def _norm_and_clip(self) -> torch.Tensor:
        clip = self._clip
        grads = [p.grad for p in self._params if p.grad is not None]
        if grads and isinstance(grads[0], DTensor):
            # FSDP2 shards: torch takes the norm across ranks and returns it as a DTensor.
            norm = torch.nn.utils.get_total_norm(grads)
            if clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self._params, clip, norm)
            return norm.full_tensor()
        device = grads[0].device if grads else "cpu"
        norm = total_norm(grads, device=device)
        if clip is not None:
            clip_(grads, max_norm=clip, norm=norm)
        return norm


class OwnGradientsOptimizer(RunOptimizer):
    """An optimizer that steps on its own copies of the gradients (torchao's offloader): the model's
    ``.grad`` may be gone by the step (``offload_gradients`` frees it during backward), so the norm
    is the optimizer's ``grad_norm()`` and clipping its ``clip_grad_norm_()``.

    torchao's optimizer has no ``clip_grad_norm_``: the config check refuses ``clip_grad_norm`` with
    an optimizer that declares it cannot clip (``recipe/checks/optimizer_rules.py``).

    Args:
        optimizer: the optimizer, with ``grad_norm()``.
        clip_grad_norm: the largest total norm, or None to measure without clipping.
        kind: what its checkpoints are checked against on resume.
    """

    def __init__(self, optimizer: Any, *, clip_grad_norm: Optional[float], kind: OptimizerKind) -> None:
        # The model's .grad is neither measured nor clipped here.
        super().__init__(optimizer, params=(), clip_grad_norm=clip_grad_norm, kind=kind)

    def _norm_and_clip(self) -> torch.Tensor:
        if self._clip is None:
            return self.optimizer.grad_norm()
        return self.optimizer.clip_grad_norm_(self._clip)


class HoldingOptimizer(OwnGradientsOptimizer):
    """This project's engine (``OffloadOptimizer``, or ``ShardedOffloadOptimizer`` on FSDP2's
    shards): it holds, measures and clips the gradients itself (over every rank, on shards), may run
    its host steps beside the next forward, and reports its timings.

    Args:
        model: with ``overlap``, each of its modules waits for its own parameters before its forward.
        kind: ``OFFLOAD_ENGINE`` or ``SHARDED_ENGINE``.
    """

    def __init__(self, optimizer: Any, *, model: torch.nn.Module, clip_grad_norm: Optional[float],
                 kind: OptimizerKind = OptimizerKind.OFFLOAD_ENGINE) -> None:
        super().__init__(optimizer, clip_grad_norm=clip_grad_norm, kind=kind)
        # With overlap on, step() returns at once and each module waits for its own weights.
        optimizer.register_forward_waits(model)

    @property
    def name(self) -> str:
        """The engine, its base optimizer and the options set away from their defaults (for the log;
        ``OffloadOptimizer``'s ``base_class`` and ``options``)."""
        engine = self.optimizer
        said = ["offload", f"base {engine.base_class.__name__}", engine.options.summary()]
        return f"{type(engine).__name__} ({'; '.join(s for s in said if s)})"

    def before_final_backward(self) -> None:
        self.optimizer.expect_final_backward(clipping=self._clip is not None)

    def synchronize(self) -> None:
        self.optimizer.synchronize()

    def timings(self) -> Dict[str, float]:
        return self.optimizer.step_timings()

    def close(self) -> None:
        self.optimizer.close()


class InBackwardOptimizers(RunOptimizer):
    """torchtune's per-parameter optimizers stepping inside backward: ``step`` has nothing left to do.

    Args:
        wrapper: torchtune's ``create_optim_in_bwd_wrapper`` result; ``get_lr`` and checkpoints read it.
    """

    def __init__(self, wrapper: Any) -> None:
        super().__init__(wrapper, params=(), clip_grad_norm=None, kind=OptimizerKind.IN_BACKWARD)

    @property
    def scheduled(self) -> torch.optim.Optimizer:
        # Built on one per-parameter optimizer, the scheduler drives all of them through the wrapper.
        return next(iter(self.optimizer.optim_map.values()))

    def attach_lr_scheduler(self, scheduler: Any) -> None:
        self.optimizer.set_lr_scheduler(scheduler)
        # torchtune's wrapper copies the learning rate to every optimizer after each scheduler
        # step only; without this the first step would run at the configured rate (not the
        # scheduler's, e.g. 0 at the start of a warm-up) on every parameter but one.
        lr = scheduler.get_last_lr()[0]
        for opt in self.optimizer.optim_map.values():
            for group in opt.param_groups:
                group["lr"] = lr

    def parts(self) -> Dict[Optional[str], torch.optim.Optimizer]:
        return dict(self.optimizer.optim_map)

    def step(self) -> Optional[torch.Tensor]:
        return None
