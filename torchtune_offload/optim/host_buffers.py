"""Which parameters an offloader moves to the host and which host buffers each gets: the rules the
engine's buffers and the memory plans (``optim/host_memory.py``) both follow."""

from typing import Any, Dict, Optional

import torch

#: Options that select a kernel, not a state layout; the meta probe cannot run fused kernels.
_KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


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
