"""NF4 weights built on the meta device without running the quantisation's arithmetic.

A QLoRA model built on the meta device (the planner's traces, the recipe's host preflight) still
quantises every base weight: torchao's ``NF4Tensor.from_tensor`` maps the weight to NF4 indices a
million elements at a time, each chunk a handful of operators that compute nothing on the meta
device but still pass through the dispatcher, and quantises the block scalers twice over in a
dozen more. For llama3_1 8B that is about 7,000 chunks and 3,000 scaler operators per build, a few
seconds each time the planner builds the model. On the meta device only shapes and dtypes matter.
The packed indices' shape follows from the weight's size alone (two indices a byte), so
:func:`nf4_on_meta_without_arithmetic` gives them directly; the scalers' are torchao's own, from
the first weight of each size and dtype the process quantises on the meta device, and later
weights of that size get new meta tensors laid out exactly so (shape, strides, offset, storage
size). Weights on a real device are quantised by torchao as before.

Copying such a model (:func:`copy_meta_model`, the planner's copies of a decoder's first layers)
skips a quantisation too: torchtune registers NF4's ``clone`` as quantising the dequantised weight
anew, and ``copy.deepcopy`` clones each tensor only to replace everything it holds with copies of
the original's.

The replacements are torchao's class attributes, so while a block is open they hold for the whole
process: another thread's meta build gets the same shapes, without torchao's arithmetic.
"""

import contextlib
import threading
from copy import deepcopy
from typing import Callable, Dict, Iterator, List, Tuple

import torch
from torch import nn
from torchao.dtypes.nf4tensor import NF4Tensor

__all__ = ["copy_meta_model", "nf4_on_meta_without_arithmetic"]

# Nesting depth of the context (any thread): the shortcuts stay installed while it is above zero;
# what they replaced, by name (taken when the first block opened, so a later patch of torchao's is kept;
# never removed: another thread may have looked a shortcut up just before the last block closed).
_depth = 0
_replaced: Dict[str, object] = {}
_lock = threading.Lock()
# The scalers' layout by (numel, dim, dtype, block sizes): for each of the three tensors, its shape,
# strides, storage offset, storage size in elements and dtype, as torchao made them on the meta device.
_Layout = Tuple[Tuple[int, ...], Tuple[int, ...], int, int, torch.dtype]
_scaler_layouts: Dict[tuple, List[_Layout]] = {}


def _original(name: str) -> Callable:
    """torchao's function (or whatever was installed before the first block opened)."""
    replaced = _replaced[name]
    return getattr(replaced, "__func__", replaced)


def _packed_indices(input_tensor: torch.Tensor, n_blocks: int, block_size: int, nf4: torch.Tensor) -> torch.Tensor:
    """``convert_to_norm_float_weight``'s result: on the meta device, its shape and dtype only."""
    numel = input_tensor.numel()
    if input_tensor.device.type != "meta" or numel % 2 or n_blocks * block_size != numel:
        # A real weight, or one torchao refuses: torchao's own code quantises it or says why.
        return _original("convert_to_norm_float_weight")(input_tensor, n_blocks, block_size, nf4)
    return torch.empty(numel // 2, dtype=torch.uint8, device="meta")


def _scalers(input_tensor: torch.Tensor, block_size: int, scaler_block_size: int) -> Tuple[torch.Tensor, ...]:
    """``double_quantize_scalers``' three tensors: on the meta device, laid out as torchao lays out
    those of the first weight of this size and dtype (which torchao's own code makes)."""
    torchaos = _original("double_quantize_scalers")
    if input_tensor.device.type != "meta":
        return torchaos(input_tensor, block_size, scaler_block_size)
    key = (input_tensor.numel(), input_tensor.dim(), input_tensor.dtype, block_size, scaler_block_size)
    layouts = _scaler_layouts.get(key)
    if layouts is None:
        made = torchaos(input_tensor, block_size, scaler_block_size)  # raises where torchao refuses the size
        layouts = [(tuple(t.shape), t.stride(), t.storage_offset(), t.untyped_storage().nbytes() // t.element_size(),
                    t.dtype) for t in made]
        _scaler_layouts[key] = layouts
    return tuple(torch.empty(size, dtype=dtype, device="meta").as_strided(shape, stride, offset)
                 for shape, stride, offset, size, dtype in layouts)


_SHORTCUTS = {"convert_to_norm_float_weight": _packed_indices, "double_quantize_scalers": _scalers}


@contextlib.contextmanager
def nf4_on_meta_without_arithmetic() -> Iterator[None]:
    """Within the block, NF4 weights made from meta tensors get their packed indices and scalers
    without the quantisation's operators (shapes, dtypes and every other tensor as torchao makes
    them); weights on other devices are quantised as always. Reentrant."""
    global _depth
    with _lock:
        if _depth == 0:
            for name, shortcut in _SHORTCUTS.items():
                _replaced[name] = NF4Tensor.__dict__[name]
                setattr(NF4Tensor, name, staticmethod(shortcut))
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for name in _SHORTCUTS:
                    setattr(NF4Tensor, name, _replaced[name])


def copy_meta_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` for a model on the meta device, its NF4 weights copied without
    torchtune's quantising ``clone``.

    ``Tensor.__deepcopy__`` makes a wrapper subclass's copy by ``clone`` and then replaces the
    copy's ``__dict__`` (for NF4: every inner tensor, the block sizes, ``_is_param``) with a deep
    copy of the original's. Here the new wrapper comes from ``detach`` instead (torchao's: a new
    NF4 wrapper of the same size, strides, dtype and device around the same inner tensors), and the
    rest is as ``Tensor.__deepcopy__`` does it, so the copy holds the same tensors and attributes
    as a deep copy would, a weight held by several modules once. (The wrapper shares the
    original's version counter until it is given storage; nothing reads it on the meta device.)
    Non-contiguous NF4 weights, whose ``clone`` makes them contiguous, weights with a gradient,
    NF4 weights elsewhere than on the meta device, and every other tensor are deep-copied.
    """
    memo: dict = {}
    for tensor in model.parameters():  # each tensor once, however many modules hold it
        if (type(tensor) is not NF4Tensor or tensor.device.type != "meta" or tensor.grad is not None
                or not tensor.is_contiguous()):
            continue
        twin = tensor.detach()
        twin.requires_grad_(tensor.requires_grad)
        twin.__dict__ = deepcopy(tensor.__dict__, memo)
        memo[id(tensor)] = twin
    return deepcopy(model, memo)
