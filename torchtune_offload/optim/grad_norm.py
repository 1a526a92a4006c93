"""Gradient norms and clipping over gradients that live on more than one device.

The arithmetic follows ``torch.nn.utils.clip_grad_norm_`` step for step (a norm per tensor, the
norm of those norms, ``max_norm / (norm + 1e-6)`` clamped at 1), so that offloaded training clips
exactly as plain training does.
"""

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, List, Sequence, Union

import torch

import torchtune_offload.optim.stream_check as stream_check

#: Host gradients of fewer bytes than this in all are measured one after the other on the calling
#: thread: starting threads costs more than the pass over them.
PARALLEL_MIN_BYTES = 64 * 2**20


def checked_norm_type(norm_type: Union[float, str]) -> float:
    """``norm_type`` as the float the norms take: a positive order, or ``inf`` (also ``"inf"``).

    Raises:
        ValueError: naming ``norm_type`` and what it takes (``"fro"`` is a matrix norm, and an order
            of 0 or below is no norm to clip by).
    """
    try:
        value = float(norm_type)
    except (TypeError, ValueError):
        value = math.nan
    if isinstance(norm_type, bool) or not value > 0:
        raise ValueError(f"norm_type={norm_type!r}: give a positive p-norm order such as 2.0, or 'inf'.")
    return value


def check_clip_arguments(max_norm: Union[float, torch.Tensor], norm_type: Union[float, str]) -> None:
    """Refuses a ``max_norm`` that would not clip: zero, negative (it would flip the gradients'
    signs) or nan (every weight nan), and a ``norm_type`` :func:`checked_norm_type` refuses. A
    tensor ``max_norm`` is taken as given: reading it would wait for its device.

    Raises:
        ValueError: naming the argument and the fix.
    """
    if not isinstance(max_norm, torch.Tensor) and (
            isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0):
        raise ValueError(f"max_norm={max_norm!r}: give a positive number (inf measures the norm without clipping).")
    checked_norm_type(norm_type)


def check_scale_factor(factor: Union[float, torch.Tensor]) -> None:
    """Refuses a number ``factor`` that is not finite; a tensor is taken as given (reading it would
    wait for its device).

    Raises:
        ValueError: naming ``factor`` and the likely cause.
    """
    if not isinstance(factor, torch.Tensor) and (isinstance(factor, bool) or not math.isfinite(factor)):
        raise ValueError(f"factor={factor!r}: give a finite number (torchtune scales by 1 / the batch's "
                         "unmasked tokens: a batch without any?).")


def tensor_norm(grad: torch.Tensor, *, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of one gradient, where it lives: one term of :func:`combine_norms`."""
    return torch.linalg.vector_norm(grad, float(norm_type))


def tensor_norms(grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """:func:`tensor_norm` (the 2-norm) of each of ``grads``, each where it lives: on the CPU in one
    ``torch._foreach_norm`` call, which there takes each tensor's ``vector_norm`` (the same bits, one
    dispatch from Python); elsewhere one ``vector_norm`` each, since a device's multi-tensor kernel
    reduces in another order than ``vector_norm``, whose bits the engine's norms keep."""
    if grads and all(g.device.type == "cpu" for g in grads):
        return list(torch._foreach_norm(list(grads), 2.0))
    return [tensor_norm(g) for g in grads]


def host_norms(grads: Sequence[torch.Tensor], *, norm_type: Union[float, str] = 2.0) -> List[torch.Tensor]:
    """:func:`tensor_norm` of each of ``grads`` (host tensors), in order, on several threads at once.

    torch measures a CPU tensor's norm on one core (6.8 GB/s for bf16 on the H100's 16-core host,
    docs/accumulation.md), so one gradient after another leaves the other cores idle. Each norm is
    still one ``tensor_norm`` call on one tensor, so the bits are those of the serial loop. Device
    gradients do not belong here: their norms are kernels, queued without a thread's help.
    """
    threads = min(torch.get_num_threads(), len(grads))
    if threads < 2 or sum(g.nbytes for g in grads) < PARALLEL_MIN_BYTES:
        return [tensor_norm(g, norm_type=norm_type) for g in grads]
    norms: List = [None] * len(grads)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="offload-norm") as pool:
        # Largest first, so that no big one starts last and runs alone.
        futures = {i: stream_check.submit(pool, _measure, grads[i], norm_type)
                   for i in sorted(range(len(grads)), key=lambda i: -grads[i].nbytes)}
        for i, future in futures.items():
            norms[i] = future.result()
    return norms


@torch.no_grad()  # grad mode is per thread: pool threads start in the default mode
def _measure(grad: torch.Tensor, norm_type: Union[float, str]) -> torch.Tensor:
    return tensor_norm(grad, norm_type=norm_type)


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
    if error_if_nonfinite:
        check_finite(result, norm_type=norm_type)
    return result


def check_finite(total: torch.Tensor, *, norm_type: float) -> None:
    """Raises ``clip_grad_norm_``'s error for a total norm that is nan or inf (reading it waits for its device)."""
    if torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped. Pass error_if_nonfinite=False to clip anyway."
        )


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
