"""The launching thread's share of a training step: the operators a pass dispatches, counted.

A GPU runs a pass no faster than one CPU thread launches its kernels: torch's dispatch of each
operator, the launch, and the Python around them (activation checkpointing's hooks, the
optimizer's gradient hooks). The speed model (``speed.StepWork.ops_per_micro_batch``) prices a
micro-batch's launching thread as its operators times the machine's ``launch_us_per_op`` plus the
engine's hand-offs times ``handoff_us``. The operators are counted as a ``TorchDispatchMode`` sees
them (after autograd, one per aten operator called), the same way in the planner's trace, in the
probe that measures the per-operator cost, and in :func:`narrowed_ops_per_micro_batch` for the
recorded runs' models.
"""

import functools
import warnings
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchtune import training
from torchtune.modules import TransformerSelfAttentionLayer

from torchtune_offload.models.narrow import NARROW_MODELS, VOCAB_SIZE, chosen_models, one_sequence

#: Width and tokens of the narrowed models whose operators are counted: the operators a layer
#: dispatches do not depend on either.
COUNT_WIDTH = 64
COUNT_TOKENS = 64
#: The depths :func:`narrowed_ops_per_micro_batch` counts at.
SHALLOW_DEPTHS = (2, 3)


class OpCounter(TorchDispatchMode):
    """Counts the aten operators dispatched while it is on (on the autograd threads too: the
    mode is part of the state autograd carries into backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    """The aten operators ``fn()`` dispatches."""
    with OpCounter() as counter:
        fn()
    return counter.count


def micro_batch(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    """One micro-batch's passes as the recipes run them, with a stand-in loss: the forward to the
    logits, their mean in float32, and the backward."""
    model(tokens).float().mean().backward()


def _ops_at_depth(name: str, num_layers: int) -> int:
    """The operators one micro-batch of ``name``'s narrowed architecture with ``num_layers`` layers
    dispatches (after one uncounted micro-batch, which makes first-use caches)."""
    _, build, depth = NARROW_MODELS[name]
    torch.manual_seed(0)
    model = build(vocab_size=VOCAB_SIZE, num_heads=4, num_kv_heads=2, embed_dim=COUNT_WIDTH, max_seq_len=COUNT_TOKENS,
                  intermediate_dim=2 * COUNT_WIDTH, **{**depth, "num_layers": num_layers}).to(torch.bfloat16)
    training.set_activation_checkpointing(model, auto_wrap_policy={TransformerSelfAttentionLayer})
    tokens = one_sequence(COUNT_TOKENS)
    with warnings.catch_warnings():
        # torchtune's RMSNorm hands torch an fp32 input with a bf16 weight, and torch's CPU kernel
        # says it will not take its fused path: a CPU speed note, nothing about the count.
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        micro_batch(model, tokens)
        model.zero_grad(set_to_none=True)
        return count_ops(lambda: micro_batch(model, tokens))


@functools.lru_cache(maxsize=None)
def narrowed_ops_per_micro_batch(name: str) -> int:
    """The operators one micro-batch of ``name`` (a key of ``models.narrow.NARROW_MODELS``)
    dispatches in bf16 with activation checkpointing, counted on its architecture narrowed to
    :data:`COUNT_WIDTH` on the CPU: at two shallow depths, and extrapolated to its layers (each
    layer dispatches the same operators, the rest of the model its own once), which counts in a
    fraction of a second what the whole model would."""
    chosen_models(name)
    few, more = SHALLOW_DEPTHS
    at_few, at_more = _ops_at_depth(name, few), _ops_at_depth(name, more)
    per_layer = (at_more - at_few) // (more - few)
    return at_few + per_layer * (NARROW_MODELS[name][2]["num_layers"] - few)
