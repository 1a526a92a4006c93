"""OffloadOptimizer: optimizer CPU offload with plain-optimizer math, on any device.

A facade over collaborators, each the only writer of its own state (docs/architecture.md):
``param_table`` (the slots), ``host_grads`` (gradients on their way to the host),
``slot_step`` (updates), ``overlap_scheduler`` (host work on worker threads), ``state_streamer``
(``update_on="device"``: states streamed to the device's update), ``step_timings``,
``offload_checkpoint`` and ``memory_report``.

Example::

    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-4, offload_gradients=True)
    loss.backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
"""

import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import torch
from torch.optim import Optimizer

from torchtune_offload.optim.base_options import check_base_options
from torchtune_offload.optim.capabilities import ENGINE_CAPABILITIES
from torchtune_offload.optim.driver_check import RECIPE_DRIVEN, check_recipe_drives
from torchtune_offload.optim.fp8_weights import DeviceWeights
from torchtune_offload.optim.grad_norm import check_clip_arguments, checked_norm_type, combine_norms
from torchtune_offload.optim.host_allocator import release_freed_host_memory
from torchtune_offload.optim.host_arena import pinning_of
from torchtune_offload.optim.host_grads import HostGradients
from torchtune_offload.optim.host_memory import HostMemoryPlan, plan_engine_memory
from torchtune_offload.optim.memory_report import OffloadMemoryReport, engine_memory_report
import torchtune_offload.optim.offload_checkpoint as offload_checkpoint
from torchtune_offload.optim.offload_checkpoint import STATE_DICT_FORMAT
from torchtune_offload.optim.offload_options import OffloadOptions, check_accumulation_steps
from torchtune_offload.optim.optimizer_class import DEFAULT_BASE, OptimizerClassSpec, resolve_optimizer_class, split_options
from torchtune_offload.optim.overlap_scheduler import OverlapScheduler
from torchtune_offload.optim.param_table import (
    ParameterTable, check_groups, named_groups, training_device,
)
from torchtune_offload.optim.slot_step import SlotStepper
from torchtune_offload.optim.state_streamer import StateStreamer
from torchtune_offload.optim.step_timings import StepTimings
from torchtune_offload.optim.transfer import TransferEngine

__all__ = ["OffloadOptimizer", "STATE_DICT_FORMAT"]


class OffloadOptimizer(Optimizer):
    """Runs a base optimizer's step on host copies of the parameters, with exact plain-optimizer math.

    A drop-in superset of ``torchao.optim.CPUOffloadOptimizer``'s constructor that also runs on a CPU-only
    machine (host copies then kept apart from the parameters, an exact emulation of the accelerator path),
    accumulates with ``offload_gradients=True``, clips the gradients it steps on, checkpoints by name
    (an example in the module's docstring).

    Args:
        params: ``model.named_parameters()`` (recommended: checkpoints are then keyed by name),
            parameters, or parameter groups of either. Frozen parameters are skipped.
        optimizer_class: the base optimizer, a class or a dotted path such as
            ``"torch.optim.AdamW"``, ``"torch.optim.SGD"`` or ``"bitsandbytes.optim.AdamW8bit"``.
        offload_gradients, minimal_size, master_dtype, grad_sum_dtype, grad_sum_on, fused_master_step,
            overlap, overlap_timeout_s, update_on, device_staging_mib, device_weights (bound to the
            model at :meth:`register_forward_waits`), handoff: the engine's own options, :class:`OffloadOptions`.
        **kwargs: passed to the base optimizer, e.g. ``lr``, ``weight_decay``, ``betas``.

    Raises:
        ValueError: on an unresolvable ``optimizer_class``, an invalid option (naming its key), no
            trainable parameters, or parameters on more than one device.
    """

    capabilities = ENGINE_CAPABILITIES

    def __init__(
        self, params: Any, optimizer_class: OptimizerClassSpec = DEFAULT_BASE, *, offload_gradients: bool = False,
        minimal_size: int = 4096, master_dtype: Optional[Union[str, torch.dtype]] = None,
        grad_sum_dtype: Optional[Union[str, torch.dtype]] = None, fused_master_step: bool = True,
        overlap: bool = False, overlap_timeout_s: Optional[float] = None, update_on: str = "host",
        device_staging_mib: Optional[float] = None, device_weights: Optional[str] = None,
        grad_sum_on: str = "host", handoff: str = "group", **kwargs: Any,
    ) -> None:
        self.base_class = resolve_optimizer_class(optimizer_class)
        # A refused option value is named here, on a one-element probe, before any host buffer exists.
        check_base_options(self.base_class, kwargs, owner=f"OffloadOptimizer (base {self.base_class.__name__})")
        self.options = OffloadOptions.parse(
            offload_gradients=offload_gradients, minimal_size=minimal_size, master_dtype=master_dtype,
            grad_sum_dtype=grad_sum_dtype, fused_master_step=fused_master_step, overlap=overlap,
            overlap_timeout_s=overlap_timeout_s, update_on=update_on, device_staging_mib=device_staging_mib,
            device_weights=device_weights, grad_sum_on=grad_sum_on, handoff=handoff,
        )
        opts = self.options
        check_recipe_drives({key: getattr(opts, key) for key in RECIPE_DRIVEN}, owner="OffloadOptimizer")
        groups = named_groups(params)
        self.device = training_device(groups)
        # Gradients freed between our long-lived host buffers would otherwise stay resident.
        release_freed_host_memory()
        self._transfer = TransferEngine(self.device)
        self._table = ParameterTable(
            groups, base_class=self.base_class, options=kwargs, accelerator=self._transfer.is_accelerator,
            minimal_size=opts.minimal_size, master_dtype=opts.master_dtype,
            grad_sum_dtype=opts.grad_sum_dtype, pinning=pinning_of(self.device), update_on=opts.update_on,
        )
        self._timings = StepTimings(streams_states=opts.update_on == "device")
        self._streamer = StateStreamer(self._table, self._transfer,
                                       staging_bytes=opts.device_staging_bytes, overlap=opts.overlap)
        self._grads = HostGradients(self._table, self._transfer, self._timings,
                                    offload_gradients=opts.offload_gradients, sum_on=opts.grad_sum_on)
        # FP8 device images of the masters (device_weights), made when the model is bound.
        self._weights = DeviceWeights(self._table, self._transfer, mode=opts.device_weights,
                                      synchronize=self.synchronize)
        self._stepper = SlotStepper(self._table, self._grads, self._transfer, self._timings,
                                    fused_master_step=opts.fused_master_step, streamer=self._streamer,
                                    device_weights=self._weights)
        self._scheduler = OverlapScheduler(self._table, self._grads, self._stepper, self._transfer,
                                           self._timings, timeout_s=opts.overlap_timeout_s, handoff=opts.handoff)
        self._hooks = []
        self._combine_norms = combine_norms  # of the per-tensor norms: see reduce_norms_with
        if opts.hands_off_in_backward:
            self._hooks.extend(s.param.register_post_accumulate_grad_hook(self.on_gradient) for s in self._table.slots)
        defaults = {k: v for k, v in self._table.slots[0].optimizer.defaults.items() if k != "fused"}
        # Inheriting Optimizer lets torch's LR schedulers and torchtune's get_lr accept us; the
        # hyper-parameters they edit in self.param_groups reach the base optimizers at each step.
        super().__init__(self._table.outer_groups, defaults)

    # The options under the constructor's names; the slots and staging ring for tests and reports.
    offload_gradients = property(lambda self: self.options.offload_gradients)
    minimal_size = property(lambda self: self.options.minimal_size)
    master_dtype = property(lambda self: self.options.master_dtype)
    grad_sum_dtype = property(lambda self: self.options.grad_sum_dtype)
    fused_master_step = property(lambda self: self.options.fused_master_step)
    overlap = property(lambda self: self.options.overlap)
    _slots = property(lambda self: self._table.slots)
    _staging = property(lambda self: self._grads.staging)

    @classmethod
    def plan_host_memory(cls, params: Any, optimizer_class: OptimizerClassSpec = DEFAULT_BASE, *,
                         device: Union[str, torch.device], gradient_accumulation_steps: int = 1,
                         **options: Any) -> HostMemoryPlan:
        """The host memory this optimizer would hold for ``params`` (meta tensors work), allocating
        nothing. Takes the constructor's arguments, the training ``device`` (host buffers are pinned
        on an accelerator, ``optim/host_arena.py``) and ``gradient_accumulation_steps`` (with
        ``offload_gradients``, more than one adds the staging ring). Refuses what the constructor refuses."""
        own, kwargs = split_options(cls.__init__, options)  # parse refuses what the constructor refuses
        return _plan_host_memory(named_groups(params), resolve_optimizer_class(optimizer_class), OffloadOptions.parse(
            **own), kwargs, device=device, gradient_accumulation_steps=gradient_accumulation_steps)

    def on_gradient(self, param: torch.Tensor) -> None:
        """The backward hook on each parameter: counted, its group handed over once complete (``handoff.py``).
        A wrapper whose parameters autograd does not reach (FSDP2's shards) calls it itself."""
        if param.grad is not None:
            self._scheduler.on_backward_grad(self._table.slot_of[param])

    def group_handoff(self, groups: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        """Hands backward's gradients over per group of ``groups`` (each this optimizer's parameters whose
        gradients arrive together, e.g. an FSDP2 unit's), not per layer and bucket; the rest as before."""
        self._scheduler.group_handoff([[self._table.slot_of[p] for p in group] for group in groups])

    def handoff_count(self) -> int:
        """How many groups of gradients the engine has taken from backward (``optim/handoff.py``)."""
        return self._scheduler.handoff.num_handoffs

    def hook_call_count(self) -> int:
        """How many gradients backward has handed to :meth:`on_gradient`."""
        return self._scheduler.handoff.num_calls

    def synchronize(self) -> None:
        """Waits for every queued host step and upload (errors raised in a worker are raised here)
        and every queued device update: needed before reading weights outside a forward that
        :meth:`register_forward_waits` covers. The host is blocked until every copy is done, so
        host code (a checkpoint, a test) may read the weights afterwards."""
        self._scheduler.synchronize()
        self._streamer.synchronize()
        self._transfer.synchronize()

    def expect_final_backward(self, *, clipping: bool) -> None:
        """Announces that the next ``backward()`` ends the accumulation window (``overlap=True``;
        a no-op otherwise). Host steps then start as gradients land (``clipping=False``; ``step()``
        refuses hyper-parameters changed since this call), or at ``step()`` after
        ``clip_grad_norm_``/``grad_norm`` (``clipping=True``).

        Args:
            clipping: the gradients will be clipped (or their norm used) before ``step()``.

        Raises:
            RuntimeError: if the previous announced window was not stepped.
        """
        if self.options.overlap and self.options.update_on == "host":
            self._scheduler.announce(clipping=clipping, param_groups=self.param_groups)

    def register_forward_waits(self, model: torch.nn.Module, *, units: Optional[Sequence[Tuple[
            torch.nn.Module, Sequence[torch.nn.Parameter]]]] = None) -> None:
        """Binds the engine to ``model``: FP8 images of its layer weights (``device_weights``; a
        ValueError if none), and with overlap each module waits, right before its forward, for its
        own parameters' steps and uploads (``model.state_dict()`` for all; a parameter read before
        its module's forward needs :meth:`synchronize`), so ``step()`` returns at once. ``units``:
        the modules that wait instead, each for its listed parameters, before its other pre-forward
        hooks (FSDP2's units, whose own pre-hook all-gathers them; ``overlap.register_module_waits``)."""
        self._weights.attach(model)
        self._scheduler.register_forward_waits(model, units=units)
        self._streamer.register_forward_waits(model, units=units)

    def reduce_norms_with(self, combine: Callable[..., torch.Tensor]) -> None:
        """Makes ``combine`` (``grad_norm.combine_norms``'s arguments) turn the per-tensor norms into
        the total norm :meth:`grad_norm` and :meth:`clip_grad_norm_` use (a reduction across ranks)."""
        self._combine_norms = combine

    def _grads_to_step(self):
        self._scheduler.synchronize()
        return self._grads.to_step()

    @torch.no_grad()
    def grad_norm(self, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
        """The total norm of the gradients the next step() will use, on the model's device; a
        ``ValueError`` for no positive ``norm_type`` (nor ``inf``), or in an overlapped window any but 2."""
        if self._scheduler.window is not None:
            if checked_norm_type(norm_type) != 2.0:
                raise ValueError(f"norm_type={norm_type}: an overlapped window measures the 2-norm only.")
            return self._combine_norms(self._scheduler.norms(), norm_type=2.0, device=self.device)
        norms = self._grads.norms(self._grads_to_step(), checked_norm_type(norm_type))
        return self._combine_norms(norms, norm_type=norm_type, device=self.device)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: Union[float, str] = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients the next step() will use, like ``torch.nn.utils.clip_grad_norm_``.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: a p-norm order, or ``inf``.
            error_if_nonfinite: raise if the total norm is nan or inf.

        Returns:
            The total norm before clipping, on the model's device: the value
            ``torch.nn.utils.clip_grad_norm_`` returns for the same model trained without offload.

        Raises:
            ValueError: for a ``max_norm`` not > 0, or no positive ``norm_type`` (nor ``inf``).
            RuntimeError: in a window announced with ``clipping=False``, whose steps have started.
        """
        check_clip_arguments(max_norm, norm_type)
        if self._scheduler.window is not None:
            return self._scheduler.clip(max_norm, norm_type, device=self.device,
                                        error_if_nonfinite=error_if_nonfinite, combine=self._combine_norms)
        return self._grads.clip_(self._grads_to_step(), max_norm, norm_type, device=self.device,
                                 error_if_nonfinite=error_if_nonfinite, combine=self._combine_norms)

    @torch.no_grad()
    def scale_grads_(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiplies the gradients the next step() will use by ``factor`` (torchtune scales by
        ``1 / num_tokens`` after backward, when the device gradients may already be gone).

        Raises:
            ValueError: for a number ``factor`` that is not finite (a tensor is taken as given).
            RuntimeError: in an overlapped window, whose gradients are already with the host steps.
        """
        if self._scheduler.window is not None:
            raise RuntimeError(
                "scale_grads_() after expect_final_backward(): the window's gradients are already "
                "with the host steps. Scale the loss before backward instead."
            )
        self._grads.scale_(self._grads_to_step(), factor)

    @torch.no_grad()
    def step(self, closure=None):
        """Steps every parameter that has a gradient; offloaded ones on the host (in an announced
        window on worker threads, without waiting for them).

        Raises:
            RuntimeError: in a window announced with ``clipping=False`` whose hyper-parameters
                changed after the announcement (its steps used the announced ones).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._weights.check_bound()
        start = time.perf_counter()
        if self._scheduler.window is not None:
            self._scheduler.step(self.param_groups)
        else:
            # Queued device updates first: they use the hyper-parameters of their own step.
            self.synchronize()
            self._stepper.step_serial(self.param_groups)
        self._timings.close_step(started=start, copies=self._transfer.copy_seconds())
        return loss

    def step_timings(self) -> Dict[str, float]:
        """Where the time of host work went in the previous ``step()``, in seconds (see
        :meth:`~torchtune_offload.optim.step_timings.StepTimings.last`); empty before the first."""
        return self._timings.last()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients on the device and marks host gradient sums empty; host sums a queued
        step still reads are left to it (it marks them empty when done), so this does not wait.

        Raises:
            RuntimeError: between :meth:`expect_final_backward` and ``step()``.
        """
        self._scheduler.handoff.flush()  # a backward that raised may have left gradients collected
        if self._scheduler.window is not None:
            raise RuntimeError("zero_grad() after expect_final_backward() and before step(): the "
                               "window's gradients are with the host steps; call step() first.")
        if not set_to_none:
            # Device gradients may still be being copied down, or read by queued updates.
            self._transfer.compute_waits_for_copies()
            self._streamer.wait_pending()
        for slot in self._table.slots:
            # Host sums a queued step still reads are left to it.
            self._grads.zero(slot, set_to_none=set_to_none, host=self._scheduler.pending(slot) is None)

    def state_dict(self) -> Dict[str, Any]:
        """A checkpoint keyed by parameter name (or position), with each slot's placement."""
        self.synchronize()
        return offload_checkpoint.state_dict(self._table, self.param_groups, base_class=self.base_class)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a checkpoint from :meth:`state_dict`, after checking that it fits.

        Raises:
            ValueError: if the checkpoint was written by another optimizer, another base
                optimizer, for other parameters (names, shapes, dtypes, groups), or with another
                on-host/on-device split (``minimal_size``). Nothing is loaded in that case (the
                states loaded before a refusal are put back, so both are held until the end).
        """
        self.synchronize()
        offload_checkpoint.load_state_dict(self._table, self.param_groups, state_dict, base_class=self.base_class,
                                           streamer=self._streamer, fp8_slots={s.index for s in self._weights.held})
        self._stepper.sync_hyperparameters(self.param_groups)
        # The checkpoint holds masters, never FP8 images: the device images are made anew.
        self._weights.requantize_all()

    def memory_report(self) -> OffloadMemoryReport:
        """Host bytes held and device bytes spared, host buffers as allocated (:meth:`plan_host_memory`'s way)."""
        return engine_memory_report(self._table, self._grads.staging, self._streamer,
                                    gradients_on_host=self.options.offload_gradients,
                                    conversion_bytes=self._stepper.conversion_bytes)

    def close(self) -> None:
        """Finishes queued host work, stops the host worker threads and removes every hook
        (backward, forward waits), leaving the model as it was."""
        try:
            self.synchronize()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            for part in (self._scheduler, self._streamer, self._weights, self._grads.staging):
                part.close()


def _plan_host_memory(groups: Any, base_class: type, opts: OffloadOptions, kwargs: Dict[str, Any], *,
                      device: Union[str, torch.device], gradient_accumulation_steps: int) -> HostMemoryPlan:
    """:meth:`OffloadOptimizer.plan_host_memory` for named ``groups``, the engine's options ``opts``
    and the base optimizer's ``kwargs``: what the constructor would refuse is refused here (a plan of
    a run that cannot start misleads), then ``host_memory.plan_engine_memory`` sizes it."""
    check_base_options(base_class, kwargs, owner=f"OffloadOptimizer (base {base_class.__name__})")
    check_accumulation_steps(gradient_accumulation_steps)
    check_groups(groups, base_class=base_class, options=kwargs)
    return plan_engine_memory(groups, base_class=base_class, opts=opts, options=kwargs, pinning=pinning_of(device),
                              gradient_accumulation_steps=gradient_accumulation_steps)
