"""Exact gradient math for any optimizer, offloading or not.

torchtune 0.6.1's recipes sum per-token losses over an accumulation window, then after backward
scale the gradients by ``1 / num_tokens`` and clip them. An offloading optimizer has by then copied
the gradients to the host (torchao does so during backward), so both calls change tensors that are
never stepped on. Here the window's tokens are counted *before* backward and each micro-batch's loss
is divided by that count, so the gradients are normalised when they are produced; clipping and the
logged norm then act on the gradients the optimizer will actually step on.
"""

from typing import Dict, Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtune_offload.optim.capabilities import OptimizerCapabilities
from torchtune_offload.optim.grad_norm import clip_, total_norm


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over ranks under ``torch.distributed`` (a copy), else ``value`` itself.

    The window's token count goes through here: gradients are averaged over ranks, so the loss
    is normalised by the tokens of all ranks.
    """
    if dist.is_available() and dist.is_initialized():
        value = value.clone()
        dist.all_reduce(value)
    return value


def loss_scale(*, num_tokens: torch.Tensor) -> torch.Tensor:
    """The factor that turns a micro-batch's summed token loss into its share of the window mean.

    Data-parallel training averages gradients over ranks; the rank count in the numerator undoes
    that average so the result is the mean over all the window's tokens on all ranks.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return world / num_tokens.clamp(min=1)


class GradientStepper:
    """Clips (or just measures) the gradients to be stepped on, then steps and zeroes them.

    Args:
        optimizer: the recipe's optimizer; ``None`` when it steps inside backward.
        params: the trainable parameters (used by plain optimizers).
        capabilities: what the optimizer declares it can do; one that holds its own gradients
            measures and clips them itself.
        clip_grad_norm: max total norm, or ``None`` to measure without clipping.

    Raises:
        ValueError: if ``clip_grad_norm`` is set for an optimizer that declares it cannot clip.
    """

    def __init__(
        self,
        *,
        optimizer: Optional[torch.optim.Optimizer],
        params: Iterable[torch.Tensor],
        capabilities: OptimizerCapabilities,
        clip_grad_norm: Optional[float],
    ) -> None:
        if clip_grad_norm is not None and not capabilities.can_clip:
            raise ValueError(
                f"clip_grad_norm={clip_grad_norm} with an optimizer that cannot clip: "
                f"{capabilities.why_not('can_clip')}. Set clip_grad_norm=null."
            )
        self.optimizer = optimizer
        self.params = [p for p in params if p.requires_grad]
        self.capabilities = capabilities
        self.clip_grad_norm = clip_grad_norm

    def before_final_backward(self) -> None:
        """Tells an optimizer that overlaps its host step that the next backward ends the window."""
        if self.optimizer is not None and self.capabilities.overlaps_host_step:
            self.optimizer.expect_final_backward(clipping=self.clip_grad_norm is not None)

    def synchronize(self) -> None:
        """Waits for an overlapping optimizer's pending host steps (before saves, at the end)."""
        if self.optimizer is not None and self.capabilities.overlaps_host_step:
            self.optimizer.synchronize()

    def step(self) -> Optional[torch.Tensor]:
        """Steps; returns the total norm of the gradients stepped on (before clipping)."""
        if self.optimizer is None:
            return None
        norm = self._norm_and_clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def timings(self) -> Dict[str, float]:
        """The optimizer's own figures for its last step, if it declares any (``step_timings``)."""
        if self.optimizer is None or not self.capabilities.step_timings:
            return {}
        return self.optimizer.step_timings()

    def _norm_and_clip(self) -> torch.Tensor:
        clip = self.clip_grad_norm
        if self.capabilities.holds_gradients:
            return self.optimizer.clip_grad_norm_(clip) if clip is not None else self.optimizer.grad_norm()
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads and isinstance(grads[0], DTensor):
            # FSDP2 shards: torch takes the norm across ranks and returns it as a DTensor.
            norm = torch.nn.utils.get_total_norm(grads)
            if clip is not None:
                torch.nn.utils.clip_grads_with_norm_(self.params, clip, norm)
            return norm.full_tensor()
        device = grads[0].device if grads else "cpu"
        norm = total_norm(grads, device=device)
        if clip is not None:
            clip_(grads, max_norm=clip, norm=norm)
        return norm
