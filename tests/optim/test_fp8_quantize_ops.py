"""``device_weights="fp8"``: the quantization and the widening as they run on the launching thread.

The quantization runs on fixed buffers with its views made once, and the device keeps the scales in
the parameter's dtype, so that an upload and a widening dispatch only the operations the design
needs. Both must give the plain formulation's bits: it is written out here as the reference.
"""

import pytest
import torch
from torch import nn

import torchtune_offload.optim.fp8_weights as fp8_weights
import torchtune_offload.optim.slot_step as slot_step
from tests.optim.test_fp8_weights import DTYPE, build, data, layered
from torchtune_offload.bench.trace_summary import dispatched_aten_ops
from torchtune_offload.optim.fp8_weights import FP8_DTYPE, FP8_MAX, dequantize, quantize
from torchtune_offload.optim.state_plan import unit_of
from torchtune_offload.optim.transfer import TransferEngine


def reference_quantize(weight: torch.Tensor, *, per_row: bool):
    """The plain formulation: per-row (or tensor) amax, the smallest power of two that brings it
    to FP8_MAX or below (1 where it is not positive), the quotient clamped and cast."""
    amax = weight.abs().amax(dim=1, keepdim=True).float()
    amax = amax if per_row else amax.amax().view(1, 1)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def reference_dequantize(q, scale, dtype):
    return q.to(dtype) * scale.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, so that NaNs compare too."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _weights():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for rows, cols in ((7, 5), (64, 224), (3, 1), (1, 9), (300, 200)):
            spread = torch.logspace(-30, 30, rows).view(rows, 1) if dtype != torch.float16 else 1.0
            yield f"{dtype}-{rows}x{cols}", (torch.randn(rows, cols, generator=g) * spread).to(dtype)
    odd = torch.randn(7, 8, generator=g).bfloat16()
    odd[1] = 0
    odd[2, 3] = float("nan")
    odd[3, 0] = float("inf")
    odd[4] = 1e-40  # subnormal in bf16
    odd[5, :4] = -0.0
    odd[6, 2] = -float("inf")
    yield "bf16 zeros nan inf subnormal", odd
    wide = torch.randn(4, 5, generator=g)
    wide[0] = 1e-44  # amax / FP8_MAX underflows fp32
    wide[1] = 3e-39
    wide[2] = 3.4e38
    yield "fp32 extremes", wide


@pytest.mark.parametrize("per_row", [True, False], ids=["per_row", "per_tensor"])
@pytest.mark.parametrize("chunk", [1 << 22, 64], ids=["one chunk", "row chunks"])
def test_quantize_and_widen_give_the_plain_formulations_bits(per_row, chunk, monkeypatch):
    monkeypatch.setattr(fp8_weights, "_CHUNK_ELEMENTS", chunk)
    for name, w in _weights():
        q, scale = quantize(w, per_row=per_row)
        want_q, want_scale = reference_quantize(w, per_row=per_row)
        assert torch.equal(_bits(q), _bits(want_q)), name
        assert torch.equal(_bits(scale), _bits(want_scale)), name
        # The device's scales in the weight's dtype widen to the same bits as the fp32 scales.
        wide = dequantize(q, scale.to(w.dtype), w.dtype)
        assert torch.equal(_bits(wide), _bits(reference_dequantize(want_q, want_scale, w.dtype))), name


#: One held weight's upload after its host step: the scales (norm, six), the values (three), the
#: scales in the weight's dtype, and one launch of both copies. Nothing is allocated.
UPLOAD_OPS = ["aten::linalg_vector_norm", "aten::gt", "aten::div_", "aten::log2_", "aten::ceil_", "aten::exp2_",
              "aten::where", "aten::div", "aten::clamp_", "aten::copy_", "aten::copy_", "aten::_foreach_copy_"]


def test_an_upload_dispatches_the_quantization_and_one_copy_launch():
    model = layered()
    opt = build(model, offload_gradients=True)
    x, y = data(1)[0]
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
    for slot in opt._weights.held:
        opt.synchronize()  # the previous upload has read the buffer before it is written again
        upload = lambda: opt._transfer.to_device_many(*opt._weights.images(slot))  # noqa: E731
        assert dispatched_aten_ops(upload) == UPLOAD_OPS, slot.key
    opt.synchronize()
    # What the uploads left on the device is the quantized masters, the scales in the weight's dtype.
    for slot in opt._weights.held:
        q, scale = opt._weights.device_image(slot)
        want_q, want_scale = reference_quantize(slot.step_param, per_row=True)
        assert scale.dtype == slot.param.dtype
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(scale.float(), want_scale), slot.key
    opt.close()


def test_a_widening_is_the_cast_and_the_product():
    model = layered()
    opt = build(model)
    layer = model.layers[0].up
    x = torch.randn(6, 64, dtype=DTYPE)
    with torch.no_grad():
        ops = dispatched_aten_ops(lambda: layer(x))
    assert ops == ["aten::to", "aten::mul_", "aten::linear"]
    opt.close()


class _Thin(nn.Module):
    """A layer whose first weight has one column: its gradient buffer has no room for its scales."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(1, 1200), nn.Tanh(), nn.Linear(1200, 8))])

    def forward(self, x):
        return self.layers[0](x)


def test_a_weight_without_room_for_its_scales_in_its_gradient_buffer_uploads_them_from_a_buffer_of_their_own():
    torch.manual_seed(0)
    model = _Thin().to(DTYPE)
    opt = build(model, minimal_size=1000, offload_gradients=True)
    assert {s.key for s in opt._weights.held} == {"layers.0.0.weight", "layers.0.2.weight"}
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 1, generator=g).to(DTYPE), torch.randn(6, 8, generator=g).to(DTYPE)
        ((model(x).float() - y.float()) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    for slot in opt._weights.held:
        q, scale = opt._weights.device_image(slot)
        want_q, want_scale = reference_quantize(slot.step_param, per_row=True)
        assert torch.equal(_bits(q), _bits(want_q)) and torch.equal(scale.float(), want_scale), slot.key
    thin = next(h for h in opt._weights._held.values() if h.slot.key == "layers.0.0.weight")
    grad = thin.slot.host_grad
    start = grad.data_ptr()
    assert not start <= thin.scale_host.data_ptr() < start + grad.numel() * grad.element_size()
    wide = next(h for h in opt._weights._held.values() if h.slot.key == "layers.0.2.weight")
    start = wide.slot.host_grad.data_ptr()
    assert start < wide.scale_host.data_ptr() < start + wide.slot.host_grad.numel() * 2
    opt.close()


@pytest.mark.parametrize("join", [False, True])
def test_a_serial_step_uploads_each_modules_new_weights_in_one_launch(join, monkeypatch):
    """Each module's new weights go up in one launch; with join, consecutive small modules' (at most
    STEP_JOB_BYTES of parameters: all of these) in one."""
    if not join:
        monkeypatch.setattr(slot_step, "STEP_JOB_BYTES", 0)
    model = layered()
    opt = build(model, offload_gradients=True)
    owner = {id(s.param): s.key for s in opt._table.offloaded}
    owner.update((id(t), s.key) for s in opt._weights.held for t in opt._weights.device_image(s))
    launches = []
    original = TransferEngine.timed_copies

    def spy(self, dsts, srcs, *, kind, stream):
        if kind == "param":
            launches.append([owner[id(d)] for d in dsts])
        return original(self, dsts, srcs, kind=kind, stream=stream)

    monkeypatch.setattr(TransferEngine, "timed_copies", spy)
    x, y = data(1)[0]
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    modules = {}
    for slot in opt._table.offloaded:
        modules.setdefault(unit_of(slot.key), []).append(slot.key)
    # Each module's slots in one launch: an FP8 weight's values and scales, any other weight itself.
    if join:
        assert [sorted(set(keys)) for keys in launches] == [sorted(k for keys in modules.values() for k in keys)]
    else:
        assert [sorted(set(keys)) for keys in launches] == [sorted(keys) for keys in modules.values()]
    held = {s.key for s in opt._weights.held}
    assert all(len(keys) == len(set(keys)) + len(held & set(keys)) for keys in launches)
    opt.close()
