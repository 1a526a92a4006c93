"""One-pass AdamW for fp32 master weights with a bf16 device copy, on the host's cores.

With ``master_dtype="fp32"`` the host step reads a bf16 (or fp32) gradient, updates the fp32 master
and its two fp32 moments, and writes the bf16 copy that goes to the device. Done with separate
passes (widen the gradient, torch's AdamW, round the master) it moves about 40 bytes per parameter;
in one pass, 28, as many as torch's fused fp32 AdamW.

The pass is the C loop in ``fused_adamw.c``, compiled with the system C compiler (``$CC``, else
the first of ``cc``, ``gcc``, ``clang`` on ``PATH``) once per process into a temporary directory (a
fraction of a second) and called through ``ctypes``, which releases the GIL, over all of torch's
intra-op threads with OpenMP. Measured against the alternatives on this project's 2-core AVX-512
CPU: ``torch.compile`` of the same math reached 0.6x of torch's fused fp32 AdamW (its generated
loop is compute-bound at a third of torch's kernel's speed in cache), chunks of widen / torch's
kernel / round 0.7x, the C loop 0.9-1.0x (see
``scripts/bench/bench_host_step.py``). Where no compiler works, :func:`fused_adamw_step` returns False and
the caller's unfused path is used, with one warning.

The math is torch's single-tensor Adam/AdamW, operation by operation in float32 with the same
rounding per operation; torch's own vectorised kernels may contract some of them into fused
multiply-adds, so results agree with torch to fp32 rounding, not always bit for bit.
"""

import ctypes
import functools
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

import torchtune_offload.optim.stream_check as stream_check

SOURCE = Path(__file__).with_name("fused_adamw.c")
#: Per-operation rounding as torch's (no contraction), vectorised for the host CPU.
_FLAGS = ("-O3", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC")
#: Options of torch's Adam/AdamW this pass implements as torch does; others take the unfused path.
_UNSUPPORTED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False}
_KERNELS = {torch.bfloat16: "adamw_bf16_grad", torch.float32: "adamw_fp32_grad"}


def c_compiler() -> Optional[List[str]]:
    """The command the pass is built with: ``$CC`` split as a shell splits it (``ccache gcc``),
    else the first of ``cc``, ``gcc``, ``clang`` on ``PATH``; None where that program is not found."""
    command = shlex.split(os.environ.get("CC", "")) or [next(filter(shutil.which, ("cc", "gcc", "clang")), "cc")]
    return command if shutil.which(command[0]) else None


def _first_error(stderr: str) -> str:
    """The compiler's first line that says ``error:`` (GCC and clang follow it with the source line
    and a caret, which say nothing alone), else its last line."""
    lines = stderr.strip().splitlines()
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")


def _compile(directory: str, source: Path = SOURCE, flags: Sequence[str] = ()) -> ctypes.CDLL:
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC, or put cc, gcc or clang on PATH)")
    errors = []
    # Best first; a compiler without -march=native or OpenMP (Apple's clang, say) still builds the
    # pass, less vectorised or on one thread.
    for attempt, extra in enumerate((("-march=native", "-fopenmp"), ("-fopenmp",), ("-march=native",), ())):
        library = os.path.join(directory, f"{source.stem}_{attempt}.so")
        # -I: the passes' shared header (bf16.h) is found beside this module, wherever the source is.
        command = [*compiler, *_FLAGS, *extra, *flags, "-I", str(SOURCE.parent), str(source), "-o", library, "-lm"]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode == 0:
                return ctypes.CDLL(library)
            errors.append(_first_error(done.stderr) or f"exit {done.returncode}")
        except OSError as err:  # the compiler cannot run, or the library cannot be loaded
            errors.append(str(err))
    raise RuntimeError(f"{' '.join(compiler)} failed: {'; '.join(dict.fromkeys(errors))}")


def build_library(source: Path, *, flags: Sequence[str] = ()) -> ctypes.CDLL:
    """Compiles the C file ``source`` as this module's pass is compiled (best flags first) and loads it.

    Args:
        source: the C file.
        flags: compiler options after the usual ones, e.g. ``("-mno-avx512f",)`` to build the pass
            as a CPU without AVX-512 runs it (benchmarks and tests of each instruction set).

    Raises:
        RuntimeError: where no compiler is found or every attempt fails.
    """
    with tempfile.TemporaryDirectory(prefix="torchtune_offload_") as directory:
        return _compile(directory, source, flags)  # loaded before the directory goes


def bind_kernels(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` (built from :data:`SOURCE`, e.g. ``build_library(SOURCE, flags=("-mno-avx2",))``)
    with its kernels' argument types set, ready for :func:`fused_adamw_step`."""
    pointer, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for name in _KERNELS.values():
        kernel = getattr(library, name)
        kernel.restype = None
        kernel.argtypes = [pointer] * 5 + [i64, i32] + [f32] * 8 + [i32, f32, i32]
    return library


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """The compiled pass, built once per process; None (and one warning) where it cannot be built."""
    try:
        with tempfile.TemporaryDirectory(prefix="torchtune_offload_") as directory:
            library = _compile(directory)  # loaded before the directory goes
    except Exception as err:  # no compiler, unsupported platform: fall back for good
        warnings.warn(f"the fused master-weight AdamW step could not be built ({type(err).__name__}: {err}); "
                      "using the unfused step (widen, torch's AdamW, round)", stacklevel=3)
        return None
    return bind_kernels(library)


#: Dtypes of a clipping factor whose every value float32 holds exactly: ``grad.mul_(factor)`` of a
#: bf16 or fp32 gradient multiplies by that float32 value (the norm, and so the factor, has the
#: gradients' dtype, bf16 in a bf16 model).
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def scale_value(grad_scale: torch.Tensor) -> float:
    """A clipping factor as the C passes take it: the float32 value ``grad.mul_(grad_scale)`` multiplies by.

    Raises:
        ValueError: if ``grad_scale`` is not a one-element tensor of a dtype in :data:`SCALE_DTYPES`
            (a float64 factor would be rounded to float32 first, which is not checked here to match
            torch's ``mul_``).
    """
    if not isinstance(grad_scale, torch.Tensor) or grad_scale.numel() != 1 or grad_scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"grad_scale={grad_scale!r}: a one-element tensor of dtype float32, bfloat16 or float16 "
                         "(the clipping factor, as clip_grad_norm_ computes it) is expected")
    return float(grad_scale)


def fuses(optimizer_class: type, options: Dict[str, Any], *, master: torch.dtype, grad: torch.dtype,
          out: torch.dtype) -> bool:
    """Whether this pass reproduces an ``optimizer_class`` built with ``options`` over a ``master``
    parameter stepped on ``grad`` gradients into an ``out`` weight: what :func:`supports` asks
    before it looks at the tensors themselves, and all a plan without tensors can ask."""
    return (optimizer_class in (torch.optim.AdamW, torch.optim.Adam)
            and all(bool(options.get(k, default)) == default for k, default in _UNSUPPORTED.items())
            and master == torch.float32 and grad in _KERNELS and out == torch.bfloat16)


def supports(optimizer: torch.optim.Optimizer, grad: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this pass reproduces ``optimizer`` (an Adam or AdamW over one fp32 tensor) on these buffers."""
    if len(optimizer.param_groups) != 1:
        return False
    group = optimizer.param_groups[0]
    (param,) = group["params"]
    # The moments too: a loaded state keeps the strides it was saved with.
    moments = [optimizer.state[param][k] for k in ("exp_avg", "exp_avg_sq") if k in optimizer.state[param]]
    return (fuses(type(optimizer), group, master=param.dtype, grad=grad.dtype, out=out.dtype)
            and all(m.dtype == torch.float32 for m in moments)
            and all(t.device.type == "cpu" and t.is_contiguous() and t.numel() == param.numel()
                    for t in (param, grad, out, *moments)))


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """AdamW's decay, or Adam's when built with ``decoupled_weight_decay=True`` (torch >= 2.6)."""
    return type(optimizer) is torch.optim.AdamW or bool(optimizer.param_groups[0].get("decoupled_weight_decay", False))


def _state(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> Dict[str, Any]:
    """The parameter's state as torch's Adam keeps it (created as torch would on its first step)."""
    state = optimizer.state[param]
    if not state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def fused_adamw_step(optimizer: torch.optim.Optimizer, grad: torch.Tensor, out: torch.Tensor, *,
                     grad_scale: Optional[torch.Tensor] = None, library: Optional[ctypes.CDLL] = None) -> bool:
    """Steps the single parameter of ``optimizer`` on ``grad`` and writes its bf16 rounding into ``out``.

    Args:
        optimizer: an Adam or AdamW over one fp32 host tensor (see :func:`supports`).
        grad: its gradient, bf16 or fp32, same number of elements.
        out: a bf16 tensor that receives the updated parameter; may be ``grad`` itself.
        grad_scale: a clipping factor (see :func:`scale_value`): the step uses ``grad.mul(grad_scale)``,
            each element rounded as ``grad.mul_(grad_scale)`` rounds it, computed in registers (one
            pass over the gradient instead of two); ``grad`` itself is left unscaled.
        library: a build from :func:`bind_kernels`; default: the pass, built at first use.

    Returns:
        True when stepped; False when the pass cannot be built here (nothing was changed then,
        and every later call returns False at once).
    """
    library = library if library is not None else _library()
    if library is None:
        return False
    group = optimizer.param_groups[0]
    (param,) = group["params"]
    state = _state(optimizer, param)
    step = float(state["step"]) + 1
    beta1, beta2 = group["betas"]
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    decoupled = _decoupled(optimizer)
    # Scalars as torch's single-tensor AdamW computes them (in Python floats) before each operation.
    stream_check.host_access(reads=[grad], writes=[param, state["exp_avg"], state["exp_avg_sq"], out],
                             what="the fused AdamW master pass (C)")
    getattr(library, _KERNELS[grad.dtype])(
        param.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr(), grad.data_ptr(),
        out.data_ptr(), param.numel(), int(decoupled), 1 - lr * weight_decay, 0.0 if decoupled else weight_decay,
        1 - beta1, beta2, 1 - beta2, (1 - beta2**step) ** 0.5, float(group["eps"]), -(lr / (1 - beta1**step)),
        int(grad_scale is not None), 1.0 if grad_scale is None else scale_value(grad_scale), torch.get_num_threads(),
    )
    state["step"].fill_(step)
    return True
