"""FP8 weights on the device, exact masters on the host (``device_weights="fp8"``).

The host engine already keeps an exact copy of every offloaded weight (the parameter's dtype, or an
fp32 master) and steps it there. With this option the device holds only a quantized image of the
offloaded 2-D weights of the transformer layers: ``torch.float8_e4m3fn`` values with a power-of-two
scale per output row (``"fp8"``) or per tensor (``"fp8_per_tensor"``), one byte per element instead
of two. A layer's forward widens the weight to the parameter's dtype right before its matmul and
drops the wide copy after; backward widens it again (only the FP8 bytes are saved for backward) and
produces the full-precision weight gradient, which lands on the ``nn.Parameter`` as before, so the
engine's gradient path (gradients offloaded or not, accumulation, clipping) is unchanged. After each host
step the master is re-quantized on the host into the consumed gradient buffer and the FP8 bytes are
uploaded: half the bytes of a bf16 upload, and no extra host buffer.

Power-of-two scales make both directions exact arithmetic: dividing by the scale only shifts
exponents, so the one rounding is the cast to FP8, and widening is ``q.to(bf16) * scale`` with no
rounding at all (every e4m3 value times a power of two is a bf16 value), so the widened weight
needs no fp32 temporary on the device.

What stays in the model's dtype: embeddings, the output head, norms, biases, anything smaller than
``minimal_size`` (it is not offloaded) and any weight not owned by one ``nn.Linear`` under a
``layers`` container (tied weights included).

The ``nn.Parameter`` keeps its shape and dtype but holds one element on the device (an expanded
zero), so optimizers, hooks and checkpoints keyed by it still work; ``model.state_dict()`` gives
the host master for it (rounded to the parameter's dtype), never the FP8 image.
"""

import contextlib
import types
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from torchtune_offload.optim.offload_options import DEVICE_WEIGHTS
from torchtune_offload.optim.param_table import ParameterTable, Slot
import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.transfer import TransferEngine

__all__ = ["DEVICE_WEIGHTS", "FP8_DTYPE", "FP8_MAX", "DeviceWeights", "dequantize", "fp8_candidates", "fp8_linear",
           "hold_in_fp8", "image_bytes", "quantize", "scale_shape"]

FP8_DTYPE = torch.float8_e4m3fn
#: The largest finite e4m3fn value.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)
#: Rows quantized at a time on the host, bounding the fp32 temporary.
_CHUNK_ELEMENTS = 1 << 22


def scale_shape(shape: torch.Size, *, per_row: bool) -> Tuple[int, int]:
    """The shape of a weight's scales: one per output row, or one for the tensor (broadcastable)."""
    return (shape[0], 1) if per_row else (1, 1)


def _rows_per_chunk(cols: int) -> int:
    """Rows of ``cols`` elements quantized at a time: :data:`_CHUNK_ELEMENTS` worth, at least one."""
    return max(1, _CHUNK_ELEMENTS // max(cols, 1))


def _row_chunks(rows: int, cols: int) -> Iterator[slice]:
    step = _rows_per_chunk(cols)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


class _Quantizer:
    """:func:`quantize` of one weight into fixed buffers, its views made once and its temporaries
    given: each call dispatches the same ten operations for a weight of one row chunk (the norm,
    six for the scales, three for the values) and allocates nothing.

    Args:
        weight: the master (2-D, any float dtype).
        out: its FP8 values (``weight``'s shape).
        scale_out: its fp32 scales (:func:`scale_shape`).
        per_row: one scale per output row, else one for the tensor.
        wide: an fp32 buffer of at least one row chunk's elements (the quotient before its cast).
        positive: a bool buffer of at least ``scale_out``'s elements.
        one: a 0-d fp32 tensor holding 1.
    """

    def __init__(self, weight: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor, *, per_row: bool,
                 wide: torch.Tensor, positive: torch.Tensor, one: torch.Tensor) -> None:
        rows, cols = weight.shape
        self.weight, self.out, self.scale, self.per_row, self.one = weight, out, scale_out, per_row, one
        self.positive = positive[:scale_out.numel()].view(scale_out.shape)
        chunks = list(_row_chunks(rows, cols))
        if len(chunks) == 1:  # no slicing at all: one chunk is the whole weight
            chunks = [slice(None)]
        self.chunks = [(weight[c], out[c], scale_out[c] if per_row else scale_out,
                        wide[:weight[c].numel()].view(weight[c].shape)) for c in chunks]

    def __call__(self) -> None:
        weight, scale = self.weight, self.scale
        # The largest magnitude per row (or of the tensor), exact: abs and max round nothing.
        torch.linalg.vector_norm(weight, float("inf"), dim=1 if self.per_row else None, keepdim=True,
                                 dtype=torch.float32, out=scale)
        # The smallest power of two s with amax / s <= FP8_MAX, in place; 1 where amax is not positive.
        torch.gt(scale, 0, out=self.positive)
        scale.div_(FP8_MAX).log2_().ceil_().exp2_()
        torch.where(self.positive, scale, self.one, out=scale)
        for w, q, s, wide in self.chunks:
            # Division by a power of two is exact; the cast to FP8 is the one rounding.
            torch.div(w, s, out=wide)
            q.copy_(wide.clamp_(-FP8_MAX, FP8_MAX))


@torch.no_grad()
def quantize(weight: torch.Tensor, *, per_row: bool, out: Optional[torch.Tensor] = None,
             scale_out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """FP8 values and power-of-two fp32 scales of a 2-D ``weight`` (``weight ~ q * scale``).

    Works row chunk by row chunk, so the fp32 temporary stays small.

    Args:
        weight: the master (any float dtype); not modified.
        per_row: one scale per output row, else one for the tensor.
        out: where the FP8 values go (``weight``'s shape, :data:`FP8_DTYPE`); new if None.
        scale_out: where the scales go (:func:`scale_shape`, fp32); new if None.

    Returns:
        ``(out, scale_out)``.
    """
    out = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device) if out is None else out
    if scale_out is None:
        scale_out = torch.empty(scale_shape(weight.shape, per_row=per_row), dtype=torch.float32, device=weight.device)
    _Quantizer(weight, out, scale_out, per_row=per_row,
               **_temporaries([weight.shape], per_row=per_row, device=weight.device))()
    return out, scale_out


def _temporaries(shapes: List[torch.Size], *, per_row: bool, device: torch.device) -> Dict[str, torch.Tensor]:
    """What :class:`_Quantizer` needs beside its buffers, for weights of these shapes: an fp32
    buffer as large as their largest row chunk, a bool per row, a 1."""
    chunk = max(min(rows, _rows_per_chunk(cols)) * cols for rows, cols in shapes)
    rows = max(rows for rows, _ in shapes) if per_row else 1
    return dict(wide=torch.empty(chunk, dtype=torch.float32, device=device),
                positive=torch.empty(rows, dtype=torch.bool, device=device),
                one=torch.ones((), dtype=torch.float32, device=device))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (exact for bf16, fp16 and fp32: the scale is a power of two).

    A scale already in ``dtype`` (a held weight's device scale) is used as it is: the widening is
    then two operations, the cast and the product."""
    wide = q.to(dtype)
    return wide.mul_(scale if scale.dtype == dtype else scale.to(dtype))


class _FP8Linear(torch.autograd.Function):
    """``F.linear`` on a weight held in FP8: widened in forward and again in backward, so only
    the FP8 bytes are saved; the weight gradient goes to ``shadow``, the (dataless) parameter."""

    @staticmethod
    def forward(ctx, x, shadow, q, scale, bias):
        ctx.save_for_backward(x, q, scale)
        ctx.dtype = shadow.dtype
        ctx.has_bias = bias is not None
        weight = dequantize(q, scale, shadow.dtype)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, q, scale = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.matmul(dequantize(q, scale, ctx.dtype))
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_b = grad_out.reshape(-1, grad_out.shape[-1]).sum(0)
        return grad_x, grad_w, None, None, grad_b


def fp8_linear(x: torch.Tensor, shadow: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``F.linear(x, dequantize(q, scale), bias)`` whose weight gradient goes to ``shadow``."""
    return _FP8Linear.apply(x, shadow, q, scale, bias)


class _WholeLayerRecompute:
    """Forward hooks that make the non-reentrant activation checkpoints created during a model's
    forward recompute whole layers (``torch.utils.checkpoint.set_checkpoint_early_stop(False)``).

    Why: with early stop, the recomputation of a layer in backward ends by an exception raised from
    the saved-tensor hook as the layer's last tensor is saved, which, in a layer ending in an FP8
    linear, is inside :class:`_FP8Linear`'s ``apply``. On CUDA (torch 2.11, H100) that exception is
    lost there and ``apply`` fails with ``SystemError: ... returned NULL without setting an
    exception``; the CPU keeps it. Without early stop only the layer's tail after its last saved
    tensor (a residual add) is recomputed in addition.
    """

    def __init__(self) -> None:
        self._open: List[contextlib.ExitStack] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.utils.checkpoint.set_checkpoint_early_stop(False))
        self._open.append(stack)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self._open.pop().close()


class _Held:
    """One weight held in FP8 on the device: its slot, module, device image (values and scales in
    the parameter's dtype), its fp32 host scales, and what its uploads quantize into (made once per
    host gradient buffer: the values in its first bytes, the scales in the parameter's dtype after them)."""

    __slots__ = ("slot", "module", "q", "scale", "host_scale", "buffer", "quantizer", "q_host", "scale_host")

    def __init__(self, slot: Slot, module: nn.Linear, q: torch.Tensor, scale: torch.Tensor,
                 host_scale: torch.Tensor) -> None:
        self.slot = slot
        self.module = module
        self.q = q
        self.scale = scale
        self.host_scale = host_scale
        self.buffer: Optional[torch.Tensor] = None
        self.quantizer: Optional[_Quantizer] = None
        self.q_host: Optional[torch.Tensor] = None
        self.scale_host: Optional[torch.Tensor] = None


def _eligible_linears(model: nn.Module) -> Dict[int, Tuple[str, nn.Linear]]:
    """``nn.Linear`` modules under a ``layers`` container whose weight no other module shares, by id(weight)."""
    owners: Dict[int, List[Tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((f"{name}.{pname}", module))
    found = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or "layers" not in name.split("."):
            continue
        users = owners.get(id(module.weight), [])
        if len({id(m) for _, m in users}) == 1:
            found[id(module.weight)] = (name, module)
    return found


def hold_in_fp8(module: nn.Linear, *, per_row: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Makes ``module`` compute with an FP8 image of its weight: new (uninitialised) FP8 values
    and scales (in the weight's dtype) on the weight's device, the weight's own storage reduced to one element, and the
    forward replaced by :func:`fp8_linear`. The caller fills the image.

    Returns:
        ``(q, scale)``, the image's values and scales.
    """
    weight = module.weight
    q = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    # In the weight's dtype, as the widening multiplies by it (a power of two: the same value).
    scale = torch.empty(scale_shape(weight.shape, per_row=per_row), dtype=weight.dtype, device=weight.device)
    # The full-size device weight goes: one element, expanded to the parameter's shape.
    weight.data = torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, q, scale, self.bias)

    module.forward = types.MethodType(forward, module)
    return q, scale


def fp8_candidates(model: nn.Module, *, minimal_size: int) -> Dict[str, nn.Linear]:
    """The layers whose weights ``device_weights="fp8"`` holds in FP8, by weight name: trainable
    2-D ``nn.Linear`` weights under a ``layers`` container, offloaded (at least ``minimal_size``
    elements), shared with no other module (for the planner, which has no optimizer)."""
    return {f"{name}.weight": module for _, (name, module) in _eligible_linears(model).items()
            if module.weight.requires_grad and module.weight.numel() >= minimal_size}


def image_bytes(weight: torch.Tensor, *, per_row: bool) -> int:
    """Device bytes of one weight's FP8 image: one per element, and its scales in the weight's dtype."""
    rows, cols = scale_shape(weight.shape, per_row=per_row)
    return weight.numel() + rows * cols * weight.element_size()


class DeviceWeights:
    """Owns the FP8 device images of the offloaded layer weights (``device_weights="fp8"``): the
    only writer of them, of their scales, and of the parameters' (dataless) device storage.

    With ``mode=None`` it holds nothing and every call is a no-op, so the engine need not ask.

    Args:
        table: the slots; only offloaded ones are held.
        transfer: uploads the FP8 bytes.
        mode: ``"fp8"`` (per-row scales), ``"fp8_per_tensor"``, or None (device weights as they are).
        synchronize: waits for queued host steps and uploads (binding and ``model.state_dict()`` call it).
    """

    def __init__(self, table: ParameterTable, transfer: TransferEngine, *, mode: Optional[str],
                 synchronize: Callable[[], None]) -> None:
        assert mode in (None, *DEVICE_WEIGHTS), mode  # OffloadOptions checked it
        self._table = table
        self._transfer = transfer
        self.mode = mode
        self.per_row = mode == "fp8"
        self._synchronize = synchronize
        self._held: Dict[int, _Held] = {}
        self.attached = False
        self._hooks: List[object] = []
        # The quantizations' temporaries, shared by the held weights (made when bound); the lock
        # only guards against two threads quantizing at once, which the engine never does.
        self._temporaries: Dict[str, torch.Tensor] = {}
        self._quantizing = stream_check.HostLock()

    def holds(self, slot: Slot) -> bool:
        """The slot's device weight is an FP8 image."""
        return slot.index in self._held

    @property
    def held(self) -> List[Slot]:
        return [h.slot for h in self._held.values()]

    @torch.no_grad()
    def attach(self, model: nn.Module) -> None:
        """Replaces the device weights of ``model``'s eligible layers by FP8 images of their masters.

        Raises:
            ValueError: if ``model`` has no eligible weight (``optimizer.device_weights``).
            RuntimeError: if called twice.
        """
        if self.mode is None:
            return
        if self.attached:
            raise RuntimeError("device_weights: the model's weights are already in FP8 (attach once).")
        self._synchronize()
        eligible = _eligible_linears(model)
        chosen = [(s, eligible[id(s.param)][1]) for s in self._table.offloaded
                  if id(s.param) in eligible and s.param.dim() == 2 and s.param.is_floating_point()]
        if not chosen:
            raise ValueError(f"optimizer.device_weights={self.mode}: the model has no offloaded nn.Linear weight under a "
                             "'layers' container (a torchtune TransformerDecoder's), so nothing would be held in "
                             "FP8. Remove optimizer.device_weights, or lower optimizer.minimal_size.")
        with stream_check.host_work():  # host memory, made once: each quantization allocates nothing
            self._temporaries = _temporaries([s.step_param.shape for s, _ in chosen], per_row=self.per_row,
                                             device=torch.device("cpu"))
        for slot, module in chosen:
            q, scale = hold_in_fp8(module, per_row=self.per_row)
            held = _Held(slot, module, q=q, scale=scale,
                         host_scale=self._transfer.host_empty_like(torch.empty(scale.shape, dtype=torch.float32)))
            self._held[slot.index] = held
            # The new device buffers were allocated on the compute stream.
            self._transfer.uploads_wait_for_compute()
            self._upload_fresh(held)
            self._hooks.append(module.register_state_dict_post_hook(self._state_dict_hook(held)))
            self._hooks.append(module.register_load_state_dict_pre_hook(self._refuse_load(held)))
        recompute = _WholeLayerRecompute()
        self._hooks.append(model.register_forward_pre_hook(recompute.enter))
        # Run when the forward raises too, so the global setting is always restored.
        self._hooks.append(model.register_forward_hook(recompute.exit, always_call=True))
        self.attached = True

    def _upload_fresh(self, held: _Held) -> None:
        """Quantizes a master into new host buffers and uploads them (attach and checkpoint loads:
        the gradient buffer may hold a sum then), waiting for the copies so that one weight's
        buffers are alive at a time."""
        with stream_check.host_work():
            q_host = self._transfer.host_empty_like(torch.empty(held.q.shape, dtype=FP8_DTYPE))
            scale_host = self._transfer.host_empty_like(torch.empty(held.scale.shape, dtype=held.scale.dtype))
            self._quantize(held.slot.step_param, q_host, held.host_scale, scale_host)
        # Values and scales up in one launch.
        self._transfer.to_device_many([held.q, held.scale], [q_host, scale_host])
        self._transfer.synchronize()

    def _quantize(self, master: torch.Tensor, q_host: torch.Tensor, host_scale: torch.Tensor,
                  scale_host: torch.Tensor, quantizer: Optional[_Quantizer] = None) -> None:
        """``quantize(master)`` into ``q_host`` and ``host_scale``, the scales also in ``scale_host``'s dtype."""
        with self._quantizing:
            quantizer = quantizer or _Quantizer(master, q_host, host_scale, per_row=self.per_row, **self._temporaries)
            quantizer()
            scale_host.copy_(host_scale)

    def check_bound(self) -> None:
        """Raises RuntimeError where FP8 weights were asked for but the model was never bound."""
        if self.mode is not None and not self.attached:
            raise RuntimeError(f"device_weights={self.mode}: the model was never bound to the optimizer, so its "
                               "forward still used full-precision weights; call register_forward_waits(model) right "
                               "after building the optimizer.")

    @torch.no_grad()
    def requantize_all(self) -> None:
        """Re-quantizes every held weight from its master (after a checkpoint load), and waits."""
        if not self._held:
            return
        # The forward and backward read the images on the compute stream.
        self._transfer.uploads_wait_for_compute()
        for held in self._held.values():
            self._upload_fresh(held)

    def images(self, slot: Slot) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """After a host step: quantizes the slot's master into its consumed gradient buffer (the
        FP8 values in its first bytes, the scales in the parameter's dtype after them).

        Returns:
            What its upload copies: the device tensors, and the host tensors to copy into them.
        """
        held = self._held[slot.index]
        if held.buffer is not slot.host_grad:
            self._bind_buffer(held)
        with stream_check.host_work():
            self._quantize(slot.step_param, held.q_host, held.host_scale, held.scale_host, held.quantizer)
        return [held.q, held.scale], [held.q_host, held.scale_host]

    def _bind_buffer(self, held: _Held) -> None:
        """Makes the views :meth:`images` quantizes into, once per gradient buffer: the values in
        its first bytes, the scales after them (in a host buffer of their own where the gradient
        buffer has no room: a weight of one or two columns)."""
        slot = held.slot
        flat = slot.host_grad.view(-1).view(torch.uint8)
        numel = slot.param.numel()
        held.q_host = flat[:numel].view(FP8_DTYPE).view(slot.param.shape)
        size = held.scale.element_size()
        start = -(-numel // size) * size
        stop = start + held.scale.numel() * size
        if stop <= flat.numel():
            held.scale_host = flat[start:stop].view(held.scale.dtype).view(held.scale.shape)
        else:
            with stream_check.host_work():
                held.scale_host = self._transfer.host_empty_like(torch.empty(held.scale.shape, dtype=held.scale.dtype))
        held.quantizer = _Quantizer(slot.step_param, held.q_host, held.host_scale, per_row=self.per_row,
                                    **self._temporaries)
        held.buffer = slot.host_grad

    def device_image(self, slot: Slot) -> Tuple[torch.Tensor, torch.Tensor]:
        """The slot's FP8 values and scales (in the parameter's dtype) on the device (for tests and checks)."""
        held = self._held[slot.index]
        return held.q, held.scale

    def _state_dict_hook(self, held: _Held):
        def hook(module, state_dict, prefix, local_metadata):
            self._synchronize()
            master = held.slot.step_param.detach()
            state_dict[prefix + "weight"] = master if master.dtype == held.slot.param.dtype else \
                master.to(held.slot.param.dtype)
        return hook

    def _refuse_load(self, held: _Held):
        def hook(module, state_dict, prefix, *args):
            if prefix + "weight" in state_dict:
                raise RuntimeError(f"{held.slot.key}: its device weight is an FP8 image of the optimizer's host "
                                   "master (device_weights=fp8); load model weights before building the optimizer, "
                                   "or resume through the optimizer's checkpoint.")
        return hook

    def close(self) -> None:
        """Stops waiting for host work in ``model.state_dict()``. The layers keep computing with
        their FP8 images and the checkpoint hooks stay, so the model's state dict still gives the
        masters (dropping them would lose the only full-precision weights)."""
        self._synchronize = lambda: None

