"""The memory an optimizer will hold, computed from parameter shapes alone (meta tensors work): every
memory plan of the package, in one module.

The recipes' pre-flight and the planner ask this before anything large is allocated. Each offloading
optimizer answers through a ``plan_host_memory`` classmethod that takes its constructor's arguments
and checks them, then sizes here (:func:`plan_engine_memory`, :func:`offloaded_buffers_plan`);
plain optimizers (``torch.optim.*``, bitsandbytes) are answered here; the device's share of the
engine (the states' staging, the device sum ring) too. The byte formulas of single buffers stay
beside the code that allocates them (``host_arena``, ``staging``, ``state_streamer``), so a plan
and an allocation cannot drift apart. Optimizer state
sizes are not tabulated: the base optimizer steps once on a meta tensor of each distinct shape and
the state it creates is measured, so any optimizer that runs on meta tensors is sized exactly.
"""

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from torchtune_offload.optim.fp8_weights import scale_shape
import torchtune_offload.optim.fused_step as fused_step
from torchtune_offload.optim.host_arena import NONE, buffer_bytes, pinned_allocation_bytes
from torchtune_offload.optim.host_buffers import converted_before_step, host_buffer_dtypes, nbytes, offloads, probe_state
from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.optim.param_table import named_groups
from torchtune_offload.optim.staging import StagingRing, device_ring_bytes, host_ring_chunks
from torchtune_offload.optim.state_plan import Layout, cached_layout, largest_slice_bytes, plan_state_bytes, slice_plan


@dataclass
class HostMemoryPlan:
    """Bytes of host memory by purpose, e.g. ``{"optimizer state": ..., "gradient buffers": ...}``.

    Attributes:
        parts: purpose -> bytes, as allocated (buffers with their alignment or the pinned
            allocator's rounding).
        notes: caveats of the estimate (a state size that could not be probed, say).
    """

    parts: Dict[str, int] = field(default_factory=dict)
    notes: Tuple[str, ...] = ()

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def add(self, purpose: str, nbytes: int) -> None:
        if nbytes:
            self.parts[purpose] = self.parts.get(purpose, 0) + int(nbytes)


def _probe_state_bytes(optimizer_class: type, shape: torch.Size, dtype: torch.dtype, options: Dict[str, Any]) -> int:
    state = probe_state(optimizer_class, shape, dtype, options)
    return sum(nbytes(t) for t in state.values() if isinstance(t, torch.Tensor))


def optimizer_state_bytes(
    optimizer_class: type, params: Iterable[torch.Tensor], options: Dict[str, Any]
) -> Tuple[int, Tuple[str, ...]]:
    """Bytes of ``optimizer_class`` state for ``params`` (one base optimizer per parameter).

    Returns:
        ``(bytes, notes)``; where the probe fails, two states of the parameter's size (Adam's) are
        assumed and a note says so.
    """
    sizes: Dict[Tuple[torch.Size, torch.dtype], int] = {}
    total, notes = 0, ()
    if optimizer_class.__module__.startswith("bitsandbytes"):
        # bitsandbytes' paged optimizers allocate real CUDA managed memory even for meta tensors,
        # which would never be freed, and its 8-bit kernels cannot step meta tensors: sized from
        # their state width instead (quantization statistics, under 1%, not counted).
        width = 2 if "8bit" in optimizer_class.__name__ else 8
        return sum(p.numel() for p in params) * width, (
            f"{optimizer_class.__name__}'s state sized as {width} bytes per parameter (not probed)",)
    for p in params:
        key = (p.shape, p.dtype)
        if key not in sizes:
            try:
                sizes[key] = _probe_state_bytes(optimizer_class, p.shape, p.dtype, options)
            except Exception as err:  # any optimizer may fail on meta tensors; fall back to Adam's size
                sizes[key] = 2 * nbytes(p)
                notes = (f"{optimizer_class.__name__}'s state could not be measured on meta tensors "
                         f"({type(err).__name__}); two states of the parameter's size assumed",)
        total += sizes[key]
    return total, notes


def offloaded_buffers_plan(
    params: Sequence[torch.Tensor],
    *,
    optimizer_class: type,
    options: Dict[str, Any],
    minimal_size: int,
    pinning: str,
    master_dtype: Optional[torch.dtype] = None,
    grad_dtype: Optional[torch.dtype] = None,
) -> HostMemoryPlan:
    """The host memory of per-parameter offloading: the buffers of :func:`host_buffer_dtypes` per
    offloaded parameter, each taking what ``pinning`` makes of it (see ``host_arena.pinning_of``),
    and the base optimizer's state."""
    plan = HostMemoryPlan()
    offloaded = [p for p in params if offloads(p, minimal_size)]
    suffix = "" if pinning == NONE else " (pinned)"
    for p in offloaded:
        for purpose, dtype in host_buffer_dtypes(p, master_dtype=master_dtype, grad_dtype=grad_dtype).items():
            plan.add(purpose + suffix, buffer_bytes(p.numel() * dtype.itemsize, pinning=pinning))
    masters = [torch.empty(p.shape, dtype=master_dtype or p.dtype, device="meta") for p in offloaded]
    state, plan.notes = optimizer_state_bytes(optimizer_class, masters, options)
    plan.add("optimizer state", state)
    return plan


def plan_host_memory(
    optimizer_class: type,
    params: Sequence[torch.Tensor],
    *,
    device: torch.device,
    gradient_accumulation_steps: int,
    options: Dict[str, Any],
) -> HostMemoryPlan:
    """The host memory ``optimizer_class(params, **options)`` will hold when training on ``device``.

    Offloading optimizers answer through their ``plan_host_memory`` classmethod; a plain optimizer
    holds its state on the host only when the device is the CPU (bitsandbytes' paged state lives in
    device memory, paged out only under device memory pressure).

    Args:
        optimizer_class: the class the config names.
        params: the trainable parameters (meta tensors will do).
        device: the training device.
        gradient_accumulation_steps: micro-batches per step.
        options: the optimizer's keyword options from the config.
    """
    own = getattr(optimizer_class, "plan_host_memory", None)
    if own is not None:
        return own(params, device=device, gradient_accumulation_steps=gradient_accumulation_steps, **options)
    plan = HostMemoryPlan()
    if torch.device(device).type == "cpu":
        state, plan.notes = optimizer_state_bytes(optimizer_class, params, options)
        plan.add("optimizer state", state)
    return plan


#: The host plan's part for ``grad_sum_on="device"`` on a machine without an accelerator.
CPU_DEVICE_RING = "gradient sum chunks (grad_sum_on=device, in host memory: no accelerator)"
#: The plan's part for ``slot_step.conversion_buffers``.
CONVERSION_BUFFERS = ("gradients converted before the step (sums wider than the weights without masters, "
                      "gradients narrower than masters the fused pass does not step)")


def plan_table_memory(params: Any, *, base_class: type, options: Dict[str, Any], minimal_size: int, pinning: str,
                      master_dtype: Optional[torch.dtype], grad_sum_dtype: Optional[torch.dtype],
                      offload_gradients: bool, gradient_accumulation_steps: int,
                      grad_sum_on: str = "host", fused_master_step: bool = True) -> HostMemoryPlan:
    """The host memory a :class:`ParameterTable` (and the ring later micro-batches' gradients are
    added through: the host's staging ring, or with ``grad_sum_on="device"`` and no accelerator the
    device ring, whose device is then this host) would hold for ``params`` (meta tensors work),
    allocating nothing; see ``OffloadOptimizer.plan_host_memory``."""
    # Each group's parameters with its own options over the optimizer's, as the table builds their
    # base optimizers (amsgrad in one group, say, adds state and keeps the fused pass from it).
    plan = HostMemoryPlan()
    trainable: List[torch.Tensor] = []
    # slot_step.conversion_buffers: for host gradients of another dtype than the stepped copy that
    # the fused pass does not read as they are, one buffer per stepped dtype, as large as its largest.
    largest: Dict[torch.dtype, int] = {}
    for group in named_groups(params):
        group_options = {**options, **{k: v for k, v in group.items() if k != "params"}}
        own = [p for _, p in group["params"] if p.requires_grad]
        trainable += own
        part = offloaded_buffers_plan(
            own, optimizer_class=base_class, options=group_options, minimal_size=minimal_size, pinning=pinning,
            master_dtype=master_dtype, grad_dtype=grad_sum_dtype,
        )
        for purpose, size in part.parts.items():
            plan.add(purpose, size)
        plan.notes = (*plan.notes, *(note for note in part.notes if note not in plan.notes))
        for p in filter(lambda p: offloads(p, minimal_size), own):
            stepped, grad = master_dtype or p.dtype, grad_sum_dtype or p.dtype
            fused = fused_master_step and fused_step.fuses(base_class, group_options, master=stepped, grad=grad,
                                                           out=p.dtype)
            converted = converted_before_step(p.dtype, stepped=stepped, grad=grad, fused=fused)
            if converted is not None:
                largest[converted] = max(largest.get(converted, 0), p.numel())
    offloaded = [p for p in trainable if offloads(p, minimal_size)]
    if largest:
        plan.add(CONVERSION_BUFFERS, sum(n * dtype.itemsize for dtype, n in largest.items()))
    if not (offload_gradients and gradient_accumulation_steps > 1 and offloaded):
        return plan
    if grad_sum_on == "host":
        chunk = StagingRing.chunk_size(largest_bytes=max(nbytes(p) for p in offloaded))
        pinned = pinning != NONE  # the ring's chunks come from torch's allocator
        plan.add("staging ring" + (" (pinned)" if pinned else ""),
                 host_ring_chunks(chunk) * pinned_allocation_bytes(chunk, pinned=pinned))
    elif pinning == NONE:
        # No accelerator: the device ring's chunks are in this host's memory.
        plan.add(CPU_DEVICE_RING, device_sum_ring_bytes(trainable, minimal_size=minimal_size,
                                                        grad_sum_dtype=grad_sum_dtype))
    return plan


def device_sum_ring_bytes(params: List[torch.Tensor], *, minimal_size: int,
                          grad_sum_dtype: Optional[torch.dtype]) -> int:
    """The bytes of the ring that adds later micro-batches into their host sums on the device
    (``grad_sum_on="device"``) for the trainable ``params`` (meta tensors work): sized by the
    largest offloaded gradient sum, in the sums' dtype; 0 where nothing is offloaded."""
    sums = [p.numel() * (p.element_size() if grad_sum_dtype is None else grad_sum_dtype.itemsize)
            for p in params if offloads(p, minimal_size)]
    return device_ring_bytes(largest_bytes=max(sums)) if sums else 0


def plan_streamed_memory(params: List[torch.Tensor], *, base_class: type, options: Dict[str, Any],
                         minimal_size: int, pinning: str) -> HostMemoryPlan:
    """The host memory of ``update_on="device"`` for trainable ``params`` (meta tensors work): the
    array states of those with at least ``minimal_size`` elements, nothing else."""
    plan, cache = HostMemoryPlan(), {}
    for p in params:
        if offloads(p, minimal_size):
            layout, _ = cached_layout(cache, base_class, options, p)
            plan.add("optimizer state" + ("" if pinning == NONE else " (pinned)"), plan_state_bytes(layout, pinning=pinning))
    return plan


def plan_device_staging(params: List[Tuple[str, torch.Tensor]], *, base_class: type, options: Dict[str, Any],
                        minimal_size: int, staging_bytes: int) -> int:
    """The device bytes of :class:`StateStreamer`'s two staging buffers for trainable ``params``
    (``(name, tensor)``; meta tensors work), allocating nothing.

    Raises:
        ValueError: as the streamer would, if a state cannot be planned or the bound is too small.
    """
    cache: Dict[tuple, Tuple[Layout, List[str]]] = {}
    plans = [slice_plan(key, base_class, p, *cached_layout(cache, base_class, options, p), staging_bytes // 2)
             for key, p in params if offloads(p, minimal_size)]
    return 2 * largest_slice_bytes(plans)


def plan_scale_bytes(params: Any, *, mode: Optional[str], minimal_size: int, pinned: bool) -> int:
    """Host bytes of the scales ``device_weights`` keeps for ``params`` (meta tensors work): at most
    one buffer per offloaded 2-D trainable weight (which of them a model's layers own is known only
    from its modules), each as torch's allocator takes it."""
    if mode is None:
        return 0
    weights = [p for g in named_groups(params) for _, p in g["params"]
               if p.requires_grad and p.dim() == 2 and offloads(p, minimal_size)]
    return sum(pinned_allocation_bytes(4 * math.prod(scale_shape(p.shape, per_row=mode == "fp8")), pinned=pinned)
               for p in weights)


def plan_engine_memory(groups: Any, *, base_class: type, opts: OffloadOptions, options: Dict[str, Any],
                       pinning: str, gradient_accumulation_steps: int) -> HostMemoryPlan:
    """The host memory ``OffloadOptimizer`` holds for named ``groups`` (meta tensors work) with its
    own options ``opts`` and its base optimizer's ``options``, buffers made as ``pinning`` makes them
    (``host_arena.pinning_of``); see ``OffloadOptimizer.plan_host_memory``, which checks the options first."""
    if opts.update_on == "device":
        trainable = [p for g in groups for _, p in g["params"] if p.requires_grad]
        return plan_streamed_memory(trainable, base_class=base_class, options=options,
                                    minimal_size=opts.minimal_size, pinning=pinning)
    plan = plan_table_memory(
        groups, base_class=base_class, options=options, minimal_size=opts.minimal_size, pinning=pinning,
        master_dtype=opts.master_dtype, grad_sum_dtype=opts.grad_sum_dtype,
        offload_gradients=opts.offload_gradients, gradient_accumulation_steps=gradient_accumulation_steps,
        grad_sum_on=opts.grad_sum_on, fused_master_step=opts.fused_master_step,
    )
    plan.add("FP8 scales (pinned)" if pinning != NONE else "FP8 scales",
             plan_scale_bytes(groups, mode=opts.device_weights, minimal_size=opts.minimal_size,
                              pinned=pinning != NONE))
    return plan
