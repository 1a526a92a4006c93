"""``dst += src`` on host tensors in one pass over all host cores: how a later micro-batch's
gradient is added into its host sum (``staging.py``).

torch's CPU ``add_`` of a bf16 gradient into an fp32 sum first converts the whole bf16 operand
into a temporary fp32 tensor (a mixed-dtype operation on the CPU is computed in the common dtype),
then adds: about 18 bytes per element instead of 10, an allocation per call, and a conversion that
ran at a tenth of the addition's speed on this project's CPU machine. The C loop in ``host_add.c``
reads each operand once, widens in registers and writes the sum once, for bf16 and fp32 sums
alike, over torch's intra-op threads with OpenMP (built as ``fused_step.build_library`` builds the
fused AdamW pass). Each element is rounded as torch's
``add_`` rounds it (one float32 addition, then round to nearest even into a bf16 sum), so the sums
are torch's bits; other dtypes, and machines where the loop cannot be built, use ``add_``. On a
CPU with AVX512_BF16 a bf16 sum is rounded by its conversion instruction, except where a sum is
denormal, which that instruction would flush.
See ``docs/accumulation.md`` for the measurements.
"""

import ctypes
import functools
import warnings
from pathlib import Path
from typing import Optional

import torch

import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.fused_step import build_library

SOURCE = Path(__file__).with_name("host_add.c")
_KERNELS = {(torch.bfloat16, torch.bfloat16): "add_bf16_bf16", (torch.float32, torch.bfloat16): "add_fp32_bf16",
            (torch.float32, torch.float32): "add_fp32_fp32"}
#: Below this many elements one thread adds (starting the others costs more than it saves).
PARALLEL_MIN = 1 << 16


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """The compiled loop, built once per process; None (and one warning) where it cannot be built."""
    try:
        library = build_library(SOURCE)
    except Exception as err:  # no compiler, unsupported platform: torch's add_ for good
        warnings.warn(f"the host gradient addition could not be built ({type(err).__name__}: {err}); "
                      "using torch's add_", stacklevel=3)
        return None
    return bind_kernels(library)


def bind_kernels(library: ctypes.CDLL) -> ctypes.CDLL:
    """Declares the argument types of the loops in ``library`` (a build of ``host_add.c``).

    Args:
        library: the loaded build, for example ``build_library(SOURCE, flags=("-mno-avx512bf16",))``.

    Returns:
        ``library``, whose kernels take ``(dst pointer, src pointer, elements, threads)``.
    """
    for name in _KERNELS.values():
        kernel = getattr(library, name)
        kernel.restype = None
        kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return library


def available() -> bool:
    """Whether this process's build of the loop exists (else :func:`add_` uses torch's ``add_``)."""
    return _library() is not None


def supports(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the loop adds ``src`` into ``dst``: contiguous host tensors of one size, a bf16 or
    fp32 sum of a bf16 or fp32 operand no wider than it."""
    return ((dst.dtype, src.dtype) in _KERNELS and dst.device.type == "cpu" and src.device.type == "cpu"
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel())


def add_(dst: torch.Tensor, src: torch.Tensor, *, library: Optional[ctypes.CDLL] = None,
         threads: Optional[int] = None) -> None:
    """``dst.add_(src)`` with the same result, in one multi-threaded pass where :func:`supports` says so.

    Args:
        dst: the host sum, changed in place.
        src: a host tensor with as many elements.
        library: the build to add with (from :func:`bind_kernels`; a benchmark compares builds);
            None, this process's build.
        threads: the C pass's threads (a benchmark sets them); None, torch's intra-op threads, or one
            below :data:`PARALLEL_MIN` elements.
    """
    if not supports(dst, src):
        library = None
    elif library is None:
        library = _library()
    if library is None:
        dst.add_(src.view_as(dst))
        return
    stream_check.host_access(reads=[dst, src], writes=[dst], what="the host gradient addition (C)")
    if threads is None:
        threads = torch.get_num_threads() if dst.numel() >= PARALLEL_MIN else 1
    getattr(library, _KERNELS[dst.dtype, src.dtype])(dst.data_ptr(), src.data_ptr(), dst.numel(), threads)
