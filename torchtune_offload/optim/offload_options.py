"""The options of :class:`~torchtune_offload.optim.OffloadOptimizer` that are its own (not the base
optimizer's), checked once, where the optimizer is built, so every error names its config key."""

from dataclasses import dataclass
from typing import Any, Optional

import torch

#: Spellings accepted for the precision options (torch dtypes are accepted too).
_DTYPES = {"fp32": torch.float32, "float32": torch.float32}


def precision_option(value: Any, *, key: str) -> Optional[torch.dtype]:
    """``None`` (the parameter's own dtype) or fp32, from a config string or a torch dtype."""
    if value is None:
        return None
    dtype = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value).lower())
    if dtype not in _DTYPES.values():
        raise ValueError(f"optimizer.{key}={value!r}: use fp32, or leave it unset (null) for the "
                         "parameter's own dtype.")
    return dtype


def _flag(value: Any, *, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"optimizer.{key}={value!r} must be True or False.")
    return value


@dataclass(frozen=True)
class OffloadOptions:
    """The options of ``OffloadOptimizer`` that are its own, validated.

    Attributes:
        offload_gradients: copy each gradient to the host as soon as backward produces it and free
            the device copy, so gradients take no device memory between micro-batches. Gradient
            accumulation still works: micro-batches are summed in host buffers.
        minimal_size: parameters with fewer elements stay on the device and step there.
        master_dtype: ``None`` (default): the base optimizer steps on a copy in the parameter's
            dtype, plain-optimizer math. fp32: it steps on fp32 master weights (fp32 state
            too), on the host for offloaded parameters and on the device for the others, and the
            parameter becomes the master rounded to its dtype after each step; pure-bf16 training
            loses small updates to rounding, this does not. The masters are checkpointed. When the
            gradient buffer has the parameter's dtype, the rounded weights are written over the
            consumed gradient (no extra host buffer), so with ``offload_gradients`` a step leaves
            no host gradient behind: the next backward starts a fresh sum, as after ``zero_grad()``.
        grad_sum_dtype: the dtype of host gradient buffers, in which ``offload_gradients`` sums
            micro-batches. ``None`` (default): the parameter's dtype, as plain training sums;
            fp32: fp32 sums.
        fused_master_step: with fp32 masters, bf16 parameters and an Adam/AdamW base, step each
            offloaded master in one pass over all host cores that also writes the rounded copy (a C
            loop built at first use, ``optim/fused_step.py``); False, or no C compiler, takes the
            unfused path (widen the gradient, the base step, round).
        overlap: run host steps on worker threads beside GPU work, with the same results. Takes
            effect for windows announced with ``expect_final_backward``; a caller that announces
            nothing gets the serial step-after-backward behaviour. With ``register_forward_waits``
            ``step()`` returns at once and the next forward waits module by module; without it
            ``step()`` waits for the host work before returning.
        overlap_timeout_s: with ``overlap``, the longest wait for one piece of host work before a
            RuntimeError says what was stuck; ``None`` (default) waits without a limit.
    """

    offload_gradients: bool
    minimal_size: int
    master_dtype: Optional[torch.dtype]
    grad_sum_dtype: Optional[torch.dtype]
    fused_master_step: bool
    overlap: bool
    overlap_timeout_s: Optional[float]

    @classmethod
    def parse(
        cls,
        *,
        offload_gradients: Any,
        minimal_size: Any,
        master_dtype: Any,
        grad_sum_dtype: Any,
        fused_master_step: Any,
        overlap: Any,
        overlap_timeout_s: Any,
    ) -> "OffloadOptions":
        """Checks config values (YAML strings included) and returns them typed.

        Raises:
            ValueError: naming the ``optimizer.<key>`` at fault and the accepted values.
        """
        master = precision_option(master_dtype, key="master_dtype")
        grad_sum = precision_option(grad_sum_dtype, key="grad_sum_dtype")
        fused = _flag(fused_master_step, key="fused_master_step")
        overlapped = _flag(overlap, key="overlap")
        offload = _flag(offload_gradients, key="offload_gradients")
        if isinstance(minimal_size, bool) or not isinstance(minimal_size, int) or minimal_size < 0:
            raise ValueError(
                f"optimizer.minimal_size={minimal_size!r} must be a non-negative integer "
                "(parameters with fewer elements step on the device; 4096 is the default)."
            )
        if overlap_timeout_s is not None and (
            isinstance(overlap_timeout_s, bool) or not isinstance(overlap_timeout_s, (int, float))
            or not overlap_timeout_s > 0
        ):
            raise ValueError(
                f"optimizer.overlap_timeout_s={overlap_timeout_s!r} must be a positive number of seconds, "
                "or null to wait for host work without a limit."
            )
        return cls(
            offload_gradients=offload, minimal_size=minimal_size, master_dtype=master,
            grad_sum_dtype=grad_sum, fused_master_step=fused, overlap=overlapped,
            overlap_timeout_s=None if overlap_timeout_s is None else float(overlap_timeout_s),
        )
