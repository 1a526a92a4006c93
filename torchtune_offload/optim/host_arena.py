"""The offload engine's long-lived host buffers, carved out of a few blocks page-locked at their exact size.

torch's pinned allocator rounds every allocation up to a power of two: Llama-3.1-8B's token
embedding, 1.05 GB in bf16, takes 2 GB, and the engine's buffers for the whole model take 16.5 GiB
for 15.0 GiB of tensors. Host RAM is what our users run out of, so on CUDA (and ROCm) the engine
allocates its buffers as plain host blocks, each buffer at a 4 KiB-aligned offset, and
page-locks each block in place with PyTorch's own ``cudaHostRegister`` helper (the one its
distributed checkpoint stager uses): pinned bytes are the tensors' bytes plus under 4 KiB each.
Other accelerators (and a torch without that helper, or a host that refuses to lock memory in place) keep
one pinned allocation per buffer, rounded as torch rounds it; a CPU-only run carves the same
blocks and locks nothing, so the layout is tested everywhere. The engine makes one block per
purpose (parameter copies, gradient buffers, device-dtype copies), so that a checkpoint of the
master weights holds the masters' block and nothing else.
"""

import functools
import math
import weakref
from typing import List, Sequence, Tuple

import torch

from torchtune_offload.optim.stream_check import host_tensor

try:  # PyTorch's in-place page-locking helper (its distributed checkpoint stager's); recent torch only
    import torch.cuda._pin_memory_utils as pin_memory_utils
except ImportError:  # older torch: buffers are pinned by its allocator, rounded
    pin_memory_utils = None

#: Every buffer starts on a page boundary.
ALIGNMENT = 4096
NONE, IN_PLACE, ALLOCATOR = "none", "in place", "allocator"


def pinning_of(device: torch.device) -> str:
    """How host buffers for ``device`` are page-locked: ``none`` (CPU), ``in place`` (exactly sized
    registered blocks, CUDA/ROCm) or ``allocator`` (torch's pinned allocator, one rounded
    allocation per buffer)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return NONE
    return IN_PLACE if kind == "cuda" and pin_memory_utils is not None else ALLOCATOR


def pinned_allocation_bytes(size: int, *, pinned: bool = True) -> int:
    """What torch's allocator takes for ``size`` bytes: pinned, the next power of two; else ``size``."""
    if not pinned or size <= 0:
        return max(size, 0)
    return 1 << (size - 1).bit_length()


def aligned_bytes(size: int) -> int:
    """``size`` rounded up to the next buffer boundary."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def buffer_bytes(size: int, *, pinning: str) -> int:
    """Host bytes one buffer of ``size`` bytes takes under ``pinning`` (see :func:`pinning_of`)."""
    return pinned_allocation_bytes(size) if pinning == ALLOCATOR else aligned_bytes(size)


class PageLockError(RuntimeError):
    """The device runtime refused to page-lock host memory in place."""


def _unlock(data_ptr: int) -> None:
    # The memory is freed right after: no copy may still be reading or writing it.
    torch.cuda.synchronize()
    pin_memory_utils.unpin_memory(data_ptr)


def _page_lock(storage: torch.UntypedStorage) -> None:
    try:
        pin_memory_utils.pin_memory(storage.data_ptr(), storage.nbytes())
    except RuntimeError as err:  # e.g. a virtualised host or WSL that refuses cudaHostRegister
        raise PageLockError(str(err)) from err
    # Unlocked when the last tensor on the block is gone, not at exit (the CUDA context may be).
    finalizer = weakref.finalize(storage, functools.partial(_unlock, storage.data_ptr()))
    finalizer.atexit = False


def host_buffers(specs: Sequence[Tuple[torch.Size, torch.dtype]], *, pinning: str) -> List[torch.Tensor]:
    """Contiguous uninitialised host tensors of the given shapes and dtypes, page-locked as ``pinning`` says.

    Args:
        specs: ``(shape, dtype)`` of each buffer.
        pinning: see :func:`pinning_of`.

    Returns:
        The buffers, in the order of ``specs``. Except with ``allocator`` pinning they share one
        block, which stays allocated (and locked) while any of them is alive; ``torch.save`` of
        any of them writes the whole block, so callers give a block only buffers saved together.

    Raises:
        PageLockError: where ``in place`` pinning is refused.
    """
    if pinning == ALLOCATOR:
        return [host_tensor(torch.empty(shape, dtype=dtype, pin_memory=True)) for shape, dtype in specs]
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += aligned_bytes(size)
    storage = torch.UntypedStorage(total)
    if pinning == IN_PLACE and total:
        _page_lock(storage)
    block = torch.empty(0, dtype=torch.uint8).set_(storage)
    return [host_tensor(block[offset:offset + size].view(dtype).view(shape))
            for offset, size, (shape, dtype) in zip(offsets, sizes, specs)]
