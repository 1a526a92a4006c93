"""Gradient norms and clipping over gradients that live on more than one device.

The arithmetic follows ``torch.nn.utils.clip_grad_norm_`` step for step (a norm per tensor, the
norm of those norms, ``max_norm / (norm + 1e-6)`` clamped at 1), so that offloaded training clips
exactly as plain training does.
"""

from typing import Iterable, Sequence, Union

import torch


def tensor_norm(grad: torch.Tensor, *, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of one gradient, where it lives: one term of :func:`combine_norms`."""
    return torch.linalg.vector_norm(grad, float(norm_type))


def combine_norms(
    norms: Sequence[torch.Tensor],
    *,
    norm_type: Union[float, str] = 2.0,
    device: Union[str, torch.device],
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """The total norm from per-tensor norms (:func:`tensor_norm`, in parameter order), on ``device``.

    Args:
        norms: one 0-dim norm per gradient, on any mix of devices.
        norm_type: a p-norm order, or ``inf``.
        device: where the result lives (the model's device).
        error_if_nonfinite: raise if the norm is nan or inf.
    """
    norm_type = float(norm_type)
    if len(norms) == 0:
        return torch.tensor(0.0, device=device)
    result = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
    if error_if_nonfinite and torch.logical_or(result.isnan(), result.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped. Pass error_if_nonfinite=False to clip anyway."
        )
    return result


def total_norm(
    grads: Sequence[torch.Tensor],
    *,
    norm_type: Union[float, str] = 2.0,
    device: Union[str, torch.device],
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` (on any mix of devices) taken together, as a 0-dim
    tensor on ``device``; the other arguments as for :func:`combine_norms`."""
    return combine_norms([tensor_norm(g, norm_type=norm_type) for g in grads], norm_type=norm_type,
                         device=device, error_if_nonfinite=error_if_nonfinite)


def clip_coefficient(*, max_norm: float, norm: torch.Tensor) -> torch.Tensor:
    """The factor gradients of total ``norm`` are multiplied by so that it is at most ``max_norm``."""
    return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)


def clip_(grads: Iterable[torch.Tensor], *, max_norm: float, norm: torch.Tensor) -> None:
    """Scales ``grads`` in place so that their total ``norm`` is at most ``max_norm``."""
    coef = clip_coefficient(max_norm=max_norm, norm=norm)
    coefs = {}
    for g in grads:
        if g.device not in coefs:
            coefs[g.device] = coef.to(g.device)
        g.mul_(coefs[g.device])
