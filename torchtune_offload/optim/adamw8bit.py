"""AdamW with blockwise 8-bit states in bitsandbytes' format, stepped on the host in one fused pass.

Each parameter of at least ``min_8bit_size`` elements keeps its two moments as uint8 codes into
bitsandbytes' dynamic quantization maps (signed for the first moment, unsigned for the second),
scaled by one fp32 absolute maximum per block of 256 elements: about 2 bytes of state per
parameter instead of 8. Smaller parameters keep fp32 moments, as bitsandbytes does. The state
keys, dtypes and shapes are bitsandbytes' (``state1``, ``state2``, ``absmax1``, ``absmax2``,
``step``; ``qmap1``/``qmap2`` in the state dict), so a state dict loads into
``bitsandbytes.optim.AdamW8bit`` and back.

A step of an 8-bit tensor, per block: dequantize both moments with the block's old absmax, apply
AdamW in float32, write the parameter, take the new absmax of each updated moment over the block
and requantize each element to its nearest code. On CPU tensors the whole step is one pass of C
(``fused_adamw8bit.c``, built at first use by the same builder as ``fused_step``) over all of
torch's threads; on other devices, or without a C compiler (one warning), the pure-torch
:func:`reference_step_8bit` runs the same math, also on meta tensors (the host-memory planner
sizes the state by stepping on them).
"""

import ctypes
import dataclasses
import functools
import math
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from torchtune_offload.optim.capabilities import PLAIN_CAPABILITIES
import torchtune_offload.optim.fused_step as fused_step
import torchtune_offload.optim.stream_check as stream_check

BLOCK_SIZE = 256
SOURCE = fused_step.SOURCE.with_name("fused_adamw8bit.c")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: Options of torch's or bitsandbytes' AdamW this optimizer does not implement, with their defaults.
_REFUSED = {"amsgrad": False, "maximize": False, "capturable": False, "differentiable": False,
            "foreach": None, "is_paged": False}
#: bitsandbytes' group keys for its other 2-state optimizers; only their defaults mean AdamW.
_BNB_GROUP_DEFAULTS = {"alpha": 0.0, "t_alpha": None, "t_beta3": None}


def dynamic_map(*, signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic 8-bit quantization map (``create_dynamic_map`` with its defaults).

    256 sorted float32 codes in [-1, 1] (signed) or [0, 1] (unsigned): for each of seven decades
    ``10**(d-6)``, the midpoints of an even split of [0.1, 1] into 2**d pieces (2**(d+1)
    unsigned), scaled by the decade; the negatives of those when signed; 0 and 1.
    """
    values = [0.0, 1.0]
    for decade in range(7):
        pieces = 2 ** decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1, pieces + 1, dtype=torch.float32)
        codes = (10 ** (decade - 6)) * ((edges[:-1] + edges[1:]) / 2.0)
        values += codes.tolist()
        if signed:
            values += (-codes).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _maps(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    return dynamic_map(signed=True).to(device), dynamic_map(signed=False).to(device)


def quantization_maps(device: Any = "cpu") -> Tuple[torch.Tensor, torch.Tensor]:
    """The (signed, unsigned) maps of the first and second moments, shared per device (read only)."""
    return _maps(torch.device(device))


def _midpoints(code: torch.Tensor) -> torch.Tensor:
    # An element goes to the code whose midpoints enclose it: the nearest code, ties to the lower.
    return (code[:-1] + code[1:]) * 0.5


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened and zero-padded to whole blocks, as (blocks, BLOCK_SIZE)."""
    flat = t.reshape(-1)
    pad = -flat.numel() % BLOCK_SIZE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK_SIZE)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """float32 values of blockwise ``codes`` (uint8), flattened into blocks as :func:`_blocks`."""
    return _blocks(code[codes.reshape(-1).long()]) * absmax[:, None]


#: A block's absmax is raised to this before its reciprocal scales the block, as bitsandbytes'
#: blockwise quantization does: below about 2**-128 the reciprocal of a subnormal absmax would
#: overflow float32 and code every element of the block at the end of the map.
SMALLEST_ABSMAX = 1e-38
#: The code of a NaN: the last one, where ``torch.bucketize`` puts a NaN (past every midpoint).
NAN_CODE = 255


def quantize(values: torch.Tensor, code: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) of float32 ``values`` shaped (blocks, BLOCK_SIZE): each block scaled by the
    reciprocal of its absolute maximum and each element sent to its nearest code.

    The edges of the float range (docs/adamw8bit.md, "Tiny, huge and non-finite values"):

    - an all-zero block stores absmax 0 and code 0 everywhere (any code dequantizes to 0);
    - a block whose absmax is below :data:`SMALLEST_ABSMAX` (1e-38, subnormal) stores its true
      absmax but is scaled by 1e38, bitsandbytes' clamp: its elements code towards zero, so it
      dequantizes smaller than it was (a moment that small changes no update: ``eps`` dominates);
    - a NaN anywhere in a block makes its absmax NaN (torch's ``amax``), and the whole block
      dequantizes to NaN; an infinite element makes it infinite, and the block's finite elements
      code as 0, which dequantizes to NaN (0 times infinity) at the next step.
    """
    absmax = values.abs().amax(dim=1)
    scaled = values * absmax.clamp(min=SMALLEST_ABSMAX).reciprocal()[:, None]
    codes = torch.bucketize(scaled, _midpoints(code))
    codes = torch.where(scaled.isnan(), NAN_CODE, codes)
    # An all-zero block has no scale; bitsandbytes writes code 0 there (any code dequantizes to 0).
    codes = torch.where((absmax == 0)[:, None], 0, codes)
    return codes.to(torch.uint8), absmax


def step_constants(group: Dict[str, Any], step: int) -> Dict[str, float]:
    """The float constants of a step of this optimizer, computed in double as Python does and used in
    float32 by :func:`reference_step_8bit` and the C pass.

    Args:
        group: a parameter group's options (``betas``, ``lr``, ``eps``, ``weight_decay``).
        step: the step's number, from 1.

    Returns:
        The constants by name, in the order the C pass takes them.
    """
    beta1, beta2 = group["betas"]
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    return {
        "beta1": beta1, "one_minus_beta1": 1 - beta1, "beta2": beta2, "one_minus_beta2": 1 - beta2,
        "inv_bias_correction2_sqrt": 1 / math.sqrt(1 - beta2**step), "eps": float(group["eps"]),
        "decay": 1 - lr * weight_decay if weight_decay > 0 else 1.0,
        "neg_step_size": -lr / (1 - beta1**step),
    }


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    # torch's vectorised float32 sqrt is not always correctly rounded (1 ulp off on about a fifth
    # of inputs on an AVX-512 CPU); sqrt in float64 rounded to float32 is, like C's sqrtf.
    return t.double().sqrt().float()


@torch.no_grad()
def reference_step_8bit(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], s: Dict[str, float]) -> None:
    """One 8-bit AdamW step of ``param`` in pure torch, each operation rounded once in float32
    (no fused multiply-add), in the order the C pass computes it."""
    qmap1, qmap2 = quantization_maps(param.device) if param.device.type != "meta" else (
        torch.empty(256, device="meta"), torch.empty(256, device="meta"))
    m = dequantize(state["state1"], state["absmax1"], qmap1)
    v = dequantize(state["state2"], state["absmax2"], qmap2)
    g = _blocks(grad.float())
    m = m * s["beta1"] + g * s["one_minus_beta1"]
    v = v * s["beta2"] + (g * g) * s["one_minus_beta2"]
    denom = _sqrt(v) * s["inv_bias_correction2_sqrt"] + s["eps"]
    p = _blocks(param.float())
    if s["decay"] != 1.0:
        p = p * s["decay"]
    p = p + (m / denom) * s["neg_step_size"]
    n = param.numel()
    param.copy_(p.reshape(-1)[:n].view_as(param))
    # The padding of a partial last block is not part of it (its dequantized zeros times an
    # infinite absmax are NaN): zeros again, so that the block's new absmax is its elements' alone.
    m.view(-1)[n:], v.view(-1)[n:] = 0.0, 0.0
    for key, values, code in (("1", m, qmap1), ("2", v, qmap2)):
        codes, absmax = quantize(values, code)
        state["state" + key].copy_(codes.reshape(-1)[:n].view_as(param))
        state["absmax" + key].copy_(absmax)


@torch.no_grad()
def reference_step_32bit(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], s: Dict[str, float]) -> None:
    """One AdamW step with fp32 moments (tensors below ``min_8bit_size``), as bitsandbytes' 32-bit
    update computes it: eps scaled by the second bias correction, one step size."""
    m, v = state["state1"], state["state2"]
    g = grad.float()
    m.mul_(s["beta1"]).add_(g * s["one_minus_beta1"])
    v.mul_(s["beta2"]).add_((g * g) * s["one_minus_beta2"])
    c2 = 1 / s["inv_bias_correction2_sqrt"]
    p = param.float()
    if s["decay"] != 1.0:
        p = p * s["decay"]
    p = p + (m / (v.sqrt() + s["eps"] * c2)) * (s["neg_step_size"] * c2)
    param.copy_(p)


def bind_kernel(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` (built from :data:`SOURCE`, or from a copy of it as the kernel benchmark builds)
    with the argument types of its ``adamw8bit_step`` set, ready for :func:`fused_step_8bit`."""
    kernel = library.adamw8bit_step
    kernel.restype = None
    kernel.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int]
                       + [ctypes.c_float] * 8 + [ctypes.c_int, ctypes.c_float, ctypes.c_int])
    return library


#: What each bit of the pass's ``adamw8bit_paths()`` says a build compiled in.
PATH_NAMES = {1: "AVX-512", 2: "AVX2 quantizer", 4: "AVX512_BF16", 8: "table checks"}


def build_paths(library: ctypes.CDLL) -> Tuple[str, ...]:
    """The loops a build of :data:`SOURCE` compiled in, by name (none: the portable loop alone)."""
    paths = library.adamw8bit_paths()
    return tuple(name for bit, name in PATH_NAMES.items() if paths & bit)


@functools.lru_cache(maxsize=None)
def _library() -> Optional[ctypes.CDLL]:
    """The compiled pass, built once per process; None (and one warning) where it cannot be built."""
    try:
        library = fused_step.build_library(SOURCE)
    except Exception as err:  # no compiler, unsupported platform: the reference, for good
        warnings.warn(f"the fused 8-bit AdamW pass could not be built ({type(err).__name__}: {err}); "
                      "AdamW8bit steps CPU tensors with its pure-torch reference, over a hundred times slower",
                      stacklevel=3)
        return None
    return bind_kernel(library)


def fused_available() -> bool:
    """Whether the C pass is built here (builds it on first call)."""
    return _library() is not None


def fused_step_8bit(param: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], s: Dict[str, float], *,
                    library: Optional[ctypes.CDLL] = None, grad_scale: Optional[torch.Tensor] = None) -> bool:
    """The C pass of :func:`reference_step_8bit` on contiguous CPU tensors, on all of torch's threads.

    Args:
        param, grad, state, s: as :func:`reference_step_8bit` takes them (``s`` from :func:`step_constants`).
        library: a library from :func:`bind_kernel`; default: the pass, built at first use.
        grad_scale: a clipping factor (see :func:`fused_step.scale_value`): the pass steps on
            ``grad.mul(grad_scale)``, computed in registers; ``grad`` itself is left unscaled.

    Returns:
        False where the pass cannot be built here (nothing was stepped), else True.
    """
    library = library if library is not None else _library()
    if library is None:
        return False
    qmap1, qmap2 = quantization_maps("cpu")
    stream_check.host_access(reads=[grad, qmap1, qmap2], writes=[param, *(state[k] for k in ("state1", "state2",
                             "absmax1", "absmax2"))], what="the fused AdamW8bit pass (C)")
    library.adamw8bit_step(
        param.data_ptr(), grad.data_ptr(), state["state1"].data_ptr(), state["state2"].data_ptr(),
        state["absmax1"].data_ptr(), state["absmax2"].data_ptr(), qmap1.data_ptr(), qmap2.data_ptr(),
        param.numel(), _DTYPES[param.dtype], _DTYPES[grad.dtype],
        s["beta1"], s["one_minus_beta1"], s["beta2"], s["one_minus_beta2"], s["inv_bias_correction2_sqrt"],
        s["eps"], s["decay"], s["neg_step_size"], int(grad_scale is not None),
        1.0 if grad_scale is None else fused_step.scale_value(grad_scale), torch.get_num_threads(),
    )
    return True


def _check_number(key: str, value: Any, low: float, high: float = math.inf, *, closed_high: bool = True,
                  where: str = "") -> None:
    one_number = isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    number = float(value) if one_number and not isinstance(value, bool) else None
    if number is None or not (low <= number and (number <= high if closed_high else number < high)):
        bound = f"[{low}, {high}{']' if closed_high else ')'}"
        raise ValueError(f"optimizer.{key}={value!r}{where} must be a number in {bound}.")


def _check_hyperparameters(options: Dict[str, Any], *, where: str = "") -> None:
    """The hyper-parameters of the constructor or of one param group (``where`` names the group).

    Raises:
        ValueError: naming the key, its value and the range it takes.
    """
    _check_number("lr", options["lr"], 0.0, where=where)
    _check_number("eps", options["eps"], 0.0, where=where)
    _check_number("weight_decay", options["weight_decay"], 0.0, where=where)
    betas = options["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"optimizer.betas={betas!r}{where} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
    for i, beta in enumerate(betas):
        _check_number(f"betas[{i}]", beta, 0.0, 1.0, closed_high=False, where=where)


class AdamW8bit(torch.optim.Optimizer):
    """AdamW with blockwise 8-bit moments in bitsandbytes' state format, fused on the host.

    Use it alone, or as the host base optimizer of :class:`~torchtune_offload.OffloadOptimizer`
    (``optimizer_class: torchtune_offload.AdamW8bit``): with gradients offloaded a bf16
    parameter then costs 6 bytes of host memory (copy 2, gradient sum 2, states 2) plus 8 bytes of
    absmax per 256 elements.

    Args:
        params: parameters or parameter groups, bf16 or fp32.
        lr: learning rate, a float or a one-element tensor.
        betas: coefficients of the moving averages of the gradient and of its square.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (AdamW's).
        min_8bit_size: tensors with fewer elements keep fp32 moments (bitsandbytes' default 4096).
        fused: True or None (default): CPU tensors step in the C pass where it can be built (else
            the reference, with one warning); False: always the pure-torch reference. Tensors on
            other devices (and meta tensors) step with the reference.
        amsgrad, maximize, capturable, differentiable, foreach, is_paged: accepted only at their
            defaults, so that a config written for torch's or bitsandbytes' AdamW fails clearly.

    Raises:
        ValueError: on a bad option (naming its key), a parameter that is neither bf16 nor fp32, or
            an FSDP2-sharded parameter (a ``DTensor``).
    """

    capabilities = dataclasses.replace(
        PLAIN_CAPABILITIES,
        runs_under_fsdp2=False,
        scales_gradients_in_step=True,
        steps_tensors_apart=True,
        reasons={
            **PLAIN_CAPABILITIES.reasons,
            "runs_under_fsdp2": "its 8-bit states are quantized in blocks of 256 elements of a whole tensor, "
            "which FSDP2's shards split, and its host pass steps plain tensors, not DTensor shards",
        },
    )

    def __init__(
        self,
        params: Any,
        *,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        min_8bit_size: int = 4096,
        fused: Optional[bool] = None,
        amsgrad: bool = False,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        foreach: Optional[bool] = None,
        is_paged: bool = False,
    ) -> None:
        given = {"amsgrad": amsgrad, "maximize": maximize, "capturable": capturable,
                 "differentiable": differentiable, "foreach": foreach, "is_paged": is_paged}
        for key, value in given.items():
            if value != _REFUSED[key]:
                raise ValueError(f"optimizer.{key}={value!r}: AdamW8bit does not implement it; remove the key "
                                 f"(or set it to {_REFUSED[key]}), or use torch.optim.AdamW.")
        _check_hyperparameters({"lr": lr, "eps": eps, "weight_decay": weight_decay, "betas": betas})
        if isinstance(min_8bit_size, bool) or not isinstance(min_8bit_size, int) or min_8bit_size < 0:
            raise ValueError(f"optimizer.min_8bit_size={min_8bit_size!r} must be a non-negative integer "
                             "(tensors with fewer elements keep fp32 moments; 4096 is bitsandbytes' default).")
        if fused not in (None, True, False):
            raise ValueError(f"optimizer.fused={fused!r} must be True, False or left unset.")
        self.min_8bit_size = min_8bit_size
        self.fused = fused
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype not in _DTYPES:
                    raise ValueError(f"params: AdamW8bit steps bf16 and fp32 parameters, not {p.dtype}; "
                                     "convert the model (dtype: bf16) or use torch.optim.AdamW.")
                if isinstance(p, DTensor):
                    raise ValueError(f"params: an FSDP2-sharded parameter (DTensor); AdamW8bit cannot step it: "
                                     f"{self.capabilities.why_not('runs_under_fsdp2')}. Use torch.optim.AdamW "
                                     "(with fsdp_cpu_offload=True to keep its state on the host).")

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's ``add_param_group``, with the group's own options checked as the constructor's.

        Raises:
            ValueError: for a key AdamW8bit does not take, or a value it refuses, naming the group.
        """
        where = f" (param group {len(self.param_groups)})"
        # torch's own bookkeeping (a scheduler's initial_lr, named parameters' names) is not an option.
        unknown = sorted(k for k in param_group if k not in ("params", "initial_lr", "param_names", *self.defaults))
        if unknown:
            raise ValueError(f"optimizer{where}: AdamW8bit takes no option {', '.join(map(repr, unknown))}; "
                             f"a group may set {', '.join(self.defaults)}.")
        _check_hyperparameters({**self.defaults, **param_group}, where=where)
        super().add_param_group(param_group)

    def _init_state(self, p: torch.Tensor) -> Dict[str, Any]:
        state = self.state[p]
        state["step"] = 0
        if p.numel() >= self.min_8bit_size:
            blocks = -(-p.numel() // BLOCK_SIZE)
            state["state1"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            state["state2"] = torch.zeros_like(p, dtype=torch.uint8, memory_format=torch.contiguous_format)
            state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
            state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        else:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        return state

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: Optional[torch.Tensor] = None):
        """Performs one step over every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            grad_scale: a clipping factor (a float32, bf16 or fp16 tensor of one element, as
                ``torch.nn.utils.clip_grad_norm_`` computes it): the step is the one that follows
                ``p.grad.mul_(grad_scale)`` for every gradient, to the bit, but the C pass multiplies
                in registers and the gradients are left unscaled (one pass over them, not two).

        Raises:
            ValueError: if ``grad_scale`` is not a float32, bf16 or fp16 tensor of one element.
        """
        if grad_scale is not None:
            fused_step.scale_value(grad_scale)  # checked before any parameter changes
            grad_scale = grad_scale.detach()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p] or self._init_state(p)
                state["step"] += 1
                self._step_tensor(p, p.grad, state, step_constants(group, state["step"]), grad_scale)
        return loss

    def _step_tensor(self, p: torch.Tensor, grad: torch.Tensor, state: Dict[str, Any], s: Dict[str, float],
                     grad_scale: Optional[torch.Tensor]) -> None:
        if grad.dtype not in _DTYPES:
            raise ValueError(f"params: a gradient of dtype {grad.dtype}; AdamW8bit steps on bf16 or fp32 gradients.")
        if (state["state1"].dtype != torch.float32 and p.device.type == "cpu" and self.fused is not False
                and p.is_contiguous() and grad.is_contiguous()
                and fused_step_8bit(p, grad, state, s, grad_scale=grad_scale)):
            return
        # The references step on a scaled copy, made by the very operation the step stands for.
        if grad_scale is not None:
            grad = grad.clone().mul_(grad_scale)
        if state["state1"].dtype == torch.float32:
            reference_step_32bit(p, grad, state, s)
        else:
            reference_step_8bit(p, grad, state, s)

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict, with bitsandbytes' ``qmap1``/``qmap2`` in each 8-bit state, so that
        ``bitsandbytes.optim.AdamW8bit.load_state_dict`` takes it."""
        sd = super().state_dict()
        states = {}
        for index, st in sd["state"].items():
            st = dict(st)
            if st.get("state1") is not None and st["state1"].dtype == torch.uint8:
                st["qmap1"], st["qmap2"] = quantization_maps(st["state1"].device)
            states[index] = st
        sd["state"] = states
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads a state dict of this class or of ``bitsandbytes.optim.AdamW8bit`` (``Optimizer8bit``'s
        wrapped quantization state included), without changing any state's dtype.

        Raises:
            ValueError: if the groups or parameters differ, a state does not fit its parameter, the
                maps are not bitsandbytes' dynamic maps, or the groups hold options of another
                bitsandbytes optimizer (AdEMAMix's ``alpha``, say).
        """
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("optimizer state dict: its parameter groups differ from this optimizer's.")
        params = {i: p for g_saved, g in zip(saved_groups, self.param_groups) for i, p in zip(g_saved["params"], g["params"])}
        new_state = {}
        for index, saved in state_dict["state"].items():
            p = params.get(index)
            if p is None:
                raise ValueError(f"optimizer state dict: state for parameter {index!r}, which no group holds.")
            saved = dict(saved)
            saved.update(saved.pop("__bnb_optimizer_quant_state__", {}))
            new_state[p] = self._loaded_state(p, saved, index)
        groups = []
        for g_saved, g in zip(saved_groups, self.param_groups):
            for key, default in _BNB_GROUP_DEFAULTS.items():
                if key in g_saved and g_saved[key] != default:
                    raise ValueError(f"optimizer state dict: group option {key}={g_saved[key]!r} is not AdamW's "
                                     f"({default!r}); it was written by another bitsandbytes optimizer.")
            group = {**g, **{k: g_saved[k] for k in self.defaults if k in g_saved}}
            group["betas"] = tuple(group["betas"])[:2]
            _check_hyperparameters(group, where=f" (param group {len(groups)} of the state dict)")
            groups.append(group)
        self.__setstate__({"state": new_state, "param_groups": groups})

    def _loaded_state(self, p: torch.Tensor, saved: Dict[str, Any], index: Any) -> Dict[str, Any]:
        eight_bit = p.numel() >= self.min_8bit_size
        expected = ({"state1": (p.shape, torch.uint8), "state2": (p.shape, torch.uint8),
                     "absmax1": ((-(-p.numel() // BLOCK_SIZE),), torch.float32),
                     "absmax2": ((-(-p.numel() // BLOCK_SIZE),), torch.float32)} if eight_bit else
                    {"state1": (p.shape, torch.float32), "state2": (p.shape, torch.float32)})
        state = {"step": int(saved["step"])}
        for key, (shape, dtype) in expected.items():
            t = saved.get(key)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                found = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
                raise ValueError(f"optimizer state dict: parameter {index!r} {key} is {found}, expected "
                                 f"{dtype}{list(shape)} (min_8bit_size={self.min_8bit_size}).")
            state[key] = t.to(p.device, copy=True).contiguous()
        if eight_bit:
            for key, code in zip(("qmap1", "qmap2"), quantization_maps("cpu")):
                if key in saved and not torch.equal(saved[key].cpu(), code):
                    raise ValueError(f"optimizer state dict: parameter {index!r} {key} is not bitsandbytes' "
                                     "dynamic map; its codes cannot be read with this optimizer's maps.")
        return state
