"""The host memory an optimizer will hold, computed from parameter shapes alone (meta tensors work).

The recipes' host-RAM pre-flight asks this before anything large is allocated. Each offloading
optimizer answers for itself through a ``plan_host_memory`` classmethod that takes its constructor's
arguments; plain optimizers (``torch.optim.*``, bitsandbytes) are answered here. Optimizer state
sizes are not tabulated: the base optimizer steps once on a meta tensor of each distinct shape and
the state it creates is measured, so any optimizer that runs on meta tensors is sized exactly.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Optional, Sequence, Tuple

import torch

from torchtune_offload.optim.host_arena import NONE, buffer_bytes

#: Options that select a kernel, not a state layout; the meta probe cannot run fused kernels.
_KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


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


def offloads(param: torch.Tensor, minimal_size: int) -> bool:
    """The placement rule of per-parameter offloaders (ours and torchao's): smaller tensors stay on the device."""
    return param.numel() >= minimal_size


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_buffer_dtypes(
    param: torch.Tensor, *, master_dtype: Optional[torch.dtype], grad_dtype: Optional[torch.dtype]
) -> Dict[str, torch.dtype]:
    """The host buffers of one offloaded parameter, by purpose: a copy to step (``master_dtype``,
    default the parameter's), a gradient buffer (``grad_dtype``), and a buffer in the parameter's
    dtype for the step's result when the master's dtype differs and the gradient buffer cannot
    hold it."""
    master, grad = master_dtype or param.dtype, grad_dtype or param.dtype
    buffers = {"parameter copies": master, "gradient buffers": grad}
    if master != param.dtype and grad != param.dtype:
        buffers["device-dtype copies"] = param.dtype
    return buffers


def converted_before_step(param_dtype: torch.dtype, *, stepped: torch.dtype, grad: torch.dtype,
                          fused: bool) -> Optional[torch.dtype]:
    """The dtype an offloaded parameter's host gradient is converted to before its step, or None
    where the step reads it as it is: a gradient of another dtype than the stepped copy is
    converted to the copy's, unless the copy is a master (not of the parameter's dtype) that the
    fused pass steps (``fused``), which reads the gradient as it is. The engine's buffers
    (``slot_step.conversion_buffers``) and the plan's part for them both follow this rule."""
    if grad == stepped or (stepped != param_dtype and fused):
        return None
    return stepped


def probe_state(optimizer_class: type, shape: torch.Size, dtype: torch.dtype,
                options: Dict[str, Any]) -> Dict[str, Any]:
    """The state ``optimizer_class`` keeps for one parameter of ``shape`` and ``dtype`` after a
    step, with meta tensors in place of its tensors (nothing is allocated).

    Raises:
        Exception: whatever the optimizer raises on meta tensors.
    """
    p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"))
    p.grad = torch.empty_like(p)
    opt = optimizer_class([p], **{k: v for k, v in options.items() if k not in _KERNEL_OPTIONS})
    opt.step()
    return dict(opt.state[p])


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
