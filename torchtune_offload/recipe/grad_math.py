"""Exact gradient math for any optimizer, offloading or not.

torchtune 0.6.1's recipes sum per-token losses over an accumulation window, then after backward
scale the gradients by ``1 / num_tokens`` and clip them. An offloading optimizer has by then copied
the gradients to the host (torchao does so during backward), so both calls change tensors that are
never stepped on. Here the window's tokens are counted *before* backward and each micro-batch's loss
is divided by that count, so the gradients are normalised when they are produced; clipping and the
logged norm then act on the gradients the optimizer will actually step on (``run_optimizer``).
"""

import torch
import torch.distributed as dist


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
