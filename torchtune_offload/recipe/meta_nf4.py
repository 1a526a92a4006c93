"""NF4 weights built on the meta device without running the quantisation's arithmetic.

A QLoRA model built on the meta device (the planner's traces, the recipe's host preflight) still
quantises every base weight: torchao's ``NF4Tensor.from_tensor`` maps the weight to NF4 indices a
million elements at a time, each chunk a handful of operators that compute nothing on the meta
device but still pass through the dispatcher. For llama3_1 8B that is about 7,000 chunks per
build, a few seconds each time the planner builds the model. On the meta device only the packed
indices' shape and dtype matter, and they follow from the weight's size alone (two indices a
byte), so :func:`nf4_on_meta_without_arithmetic` gives them directly. Weights on a real device
are quantised by torchao as before, and the block scalers (small) always are.

The replacement is torchao's class attribute, so while a block is open it holds for the whole
process: another thread's meta build gets the same shapes, without torchao's arithmetic.
"""

import contextlib
import threading
from typing import Iterator

import torch
from torchao.dtypes.nf4tensor import NF4Tensor

__all__ = ["nf4_on_meta_without_arithmetic"]

_NAME = "convert_to_norm_float_weight"
# Nesting depth of the context (any thread): the shortcut stays installed while it is above zero;
# what it replaced (taken when the first block opened, so a later patch of torchao's is kept).
_depth = 0
_replaced = None
_lock = threading.Lock()


def _packed_indices(input_tensor: torch.Tensor, n_blocks: int, block_size: int, nf4: torch.Tensor) -> torch.Tensor:
    """``convert_to_norm_float_weight``'s result: on the meta device, its shape and dtype only."""
    numel = input_tensor.numel()
    if input_tensor.device.type != "meta" or numel % 2 or n_blocks * block_size != numel:
        # A real weight, or one torchao refuses: torchao's own code quantises it or says why.
        return getattr(_replaced, "__func__", _replaced)(input_tensor, n_blocks, block_size, nf4)
    return torch.empty(numel // 2, dtype=torch.uint8, device="meta")


@contextlib.contextmanager
def nf4_on_meta_without_arithmetic() -> Iterator[None]:
    """Within the block, NF4 weights made from meta tensors get their packed indices without the
    quantisation's per-chunk operators (shapes, dtypes and every other tensor as torchao makes
    them); weights on other devices are quantised as always. Reentrant."""
    global _depth, _replaced
    with _lock:
        if _depth == 0:
            _replaced = NF4Tensor.__dict__[_NAME]
            setattr(NF4Tensor, _NAME, staticmethod(_packed_indices))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                setattr(NF4Tensor, _NAME, _replaced)
