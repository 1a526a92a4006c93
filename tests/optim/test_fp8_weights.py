"""``device_weights="fp8"``: FP8 layer weights on the device, exact masters on the host.

The gradients of an FP8 run differ from a bf16 run's (the forward used the widened FP8 weights), so
the reference is plain ``torch.optim.AdamW`` fed the gradients the engine itself computed, captured
by a hook that runs before the engine's: its weights must equal the engine's host masters bit for
bit after every step, and the device images must equal the quantized masters after every step.
"""

import contextlib
import copy

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tests.optim.side_by_side import through_a_file
from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.optim.fp8_weights import FP8_DTYPE, FP8_MAX, dequantize, quantize
from torchtune_offload.optim.stream_check import StreamOrderError, checked_streams

DTYPE = torch.bfloat16
#: Layer linears (64 x 128 = 8192 elements) are offloaded; the input projection (24 x 64) is not.
MINIMAL_SIZE = 4096


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Layered(nn.Module):
    """A stand-in for a TransformerDecoder: linears under ``layers``, an offloaded head outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(24, 64)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.norm = nn.LayerNorm(64)
        self.output = nn.Linear(64, 80)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def layered(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Layered().to(DTYPE)


def data(num: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 24, generator=g).to(DTYPE), torch.randn(6, 80, generator=g).to(DTYPE))
            for _ in range(num)]


class GradientTap:
    """Sums each micro-batch's gradient as autograd would (in place, in the parameter's dtype),
    from a hook registered before the engine's, so it sees each gradient before it leaves."""

    def __init__(self, model: nn.Module) -> None:
        self.sums = {}
        self._seen = {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(self._hook(name))

    def _hook(self, name):
        def hook(p):
            if name in self.sums and self._seen[name] is not p.grad:
                # The engine took the previous micro-batch's gradient away (offload_gradients).
                self.sums[name].add_(p.grad)
            else:
                # Autograd keeps the running sum in p.grad itself.
                self.sums[name] = p.grad.detach().clone()
            self._seen[name] = p.grad
        return hook

    def clear(self) -> None:
        self.sums.clear()
        self._seen.clear()


def build(model, optimizer_class="torch.optim.AdamW", **options):
    defaults = dict(minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1, device_weights="fp8")
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, **{**defaults, **options})
    opt.register_forward_waits(model)
    return opt


def assert_images_are_quantized_masters(opt, *, per_row=True):
    held = opt._weights.held
    assert held, "no weight is held in FP8"
    for slot in held:
        q, scale = opt._weights.device_image(slot)
        want_q, want_scale = quantize(slot.step_param.cpu(), per_row=per_row)
        assert torch.equal(q.view(torch.uint8).cpu(), want_q.view(torch.uint8)), slot.key
        assert torch.equal(scale.cpu(), want_scale), slot.key


#: The engine's gradient path: (offload_gradients, grad_sum_on); the device sums only offloaded gradients.
GRADIENT_PATHS = {"on the device": (False, "host"), "host sums": (True, "host"), "device-added sums": (True, "device")}


@pytest.mark.parametrize("path", list(GRADIENT_PATHS))
@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("master_dtype", [None, "fp32"])
@pytest.mark.parametrize("overlap", [False, True])
def test_master_equals_plain_adamw_on_the_engines_gradients(path, grad_accum, clip, master_dtype, overlap):
    offload_gradients, grad_sum_on = GRADIENT_PATHS[path]
    train_beside_plain_adamw("cpu", offload_gradients=offload_gradients, grad_accum=grad_accum, clip=clip,
                             master_dtype=master_dtype, overlap=overlap, grad_sum_on=grad_sum_on)


@pytest.mark.gpu
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("overlap", [False, True])
def test_on_the_accelerator_the_master_follows_plain_adamw(offload_gradients, clip, overlap):
    """The same on a real device: its streams, pinned buffers and kernels (the CPU run shares none)."""
    train_beside_plain_adamw(str(torch.accelerator.current_accelerator()), offload_gradients=offload_gradients,
                             grad_accum=2, clip=clip, master_dtype=None, overlap=overlap)


def train_beside_plain_adamw(device, *, offload_gradients, grad_accum, clip, master_dtype, overlap=False,
                             grad_sum_on="host"):
    """Trains the layered model with FP8 device weights beside plain AdamW fed the engine's own
    gradients; after every step each parameter must equal plain AdamW's, and the device images the
    quantized masters. Plain AdamW runs where the engine steps each parameter, with the kernel it
    uses there: host copies (offloaded or with a master) on the host, parameters below
    ``minimal_size`` on the device with the device's default AdamW (an H100 run compared those
    with the host's fused kernel: its bf16 roundings differ from the device's multi-kernel step by
    more than any tolerance near zero)."""
    model = layered().to(device)
    master_type = torch.float32 if master_dtype else DTYPE
    # Taken before the engine replaces the held weights by their FP8 images.
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    tap = GradientTap(model)
    # The fused master pass rounds its multiply-adds differently (tests/optim/test_master_weights.py):
    # the unfused path is plain AdamW's math, so the masters must be equal.
    opt = build(model, offload_gradients=offload_gradients, master_dtype=master_dtype, fused_master_step=False,
                overlap=overlap, grad_sum_on=grad_sum_on)
    held = {s.key for s in opt._weights.held}
    assert held == {f"layers.{i}.{m}.weight" for i in range(2) for m in ("up", "down")}
    # Offloaded parameters step on host copies; those below minimal_size step where they live (on
    # their fp32 master there, with master_dtype).
    on_host = {s.key for s in opt._slots if s.offloaded}
    assert held <= on_host and len(on_host) < len(opt._slots), "both kinds of parameter must be checked"
    ref = {n: nn.Parameter(p.to("cpu" if n in on_host else device, master_type)) for n, p in initial.items()}
    # On a machine with an accelerator the engine steps host copies with torch's fused CPU AdamW
    # (optim/param_table.py); the per-tensor loop's sqrt (MKL's) rounds differently on some CPUs.
    host_ref_opt = torch.optim.AdamW([ref[n] for n in ref if n in on_host], lr=1e-2, weight_decay=0.1,
                                     fused=device != "cpu")
    on_device = [ref[n] for n in ref if n not in on_host]
    device_ref_opt = torch.optim.AdamW(on_device, lr=1e-2, weight_decay=0.1) if on_device else None
    assert_images_are_quantized_masters(opt)
    batches = [(x.to(device), y.to(device)) for x, y in data(4 * grad_accum)]
    for start in range(0, len(batches), grad_accum):
        tap.clear()
        window = batches[start:start + grad_accum]
        for i, (x, y) in enumerate(window):
            if overlap and i == len(window) - 1:
                opt.expect_final_backward(clipping=clip is not None)
            loss = ((model(x).float() - y.float()) ** 2).mean()
            # Overlapped steps take the last gradients as they arrive: the loss is scaled instead
            # (by a power of two, so the sums are those of the scaled gradients exactly).
            (loss / grad_accum if overlap else loss).backward()
        if not overlap:
            opt.scale_grads_(1.0 / grad_accum)
        # Scaled and clipped in the parameters' dtype, as plain training does, then widened for a master.
        holders = {name: nn.Parameter(torch.empty_like(tap.sums[name])) for name in ref}
        for name, h in holders.items():
            h.grad = tap.sums[name] if overlap else tap.sums[name].mul_(1.0 / grad_accum)
        if clip is not None:
            norm = opt.clip_grad_norm_(clip)
            ref_norm = torch.nn.utils.get_total_norm([h.grad for h in holders.values()])
            # A device reduces the norms in another order than the host: equal to rounding (equal
            # on the CPU). Plain AdamW then clips with the engine's norm, so that what follows
            # compares the steps, not two roundings of the norm.
            if device == "cpu":
                assert torch.equal(norm, ref_norm)
            else:
                torch.testing.assert_close(norm.to(ref_norm.device), ref_norm)
            assert float(ref_norm) > clip, "the clip threshold must bite"
            torch.nn.utils.clip_grads_with_norm_(holders.values(), clip, norm.to(ref_norm.device))
        for name, p in ref.items():
            p.grad = holders[name].grad.to(p.device, p.dtype)
        opt.step()
        host_ref_opt.step()
        if device_ref_opt is not None:
            device_ref_opt.step()
        opt.zero_grad()
        if overlap:
            opt.synchronize()
        for slot in opt._slots:
            stepped = slot.step_param if slot.offloaded or slot.has_master else slot.param
            assert torch.equal(stepped, ref[slot.key]), slot.key
        assert_images_are_quantized_masters(opt)
    # The layers' device weights hold one element; everything else is a full tensor.
    for slot in opt._slots:
        assert slot.param.untyped_storage().nbytes() == (slot.param.element_size() if slot.key in held
                                                         else slot.param.numel() * slot.param.element_size())
    opt.close()


@pytest.mark.parametrize("per_row", [True, False])
def test_quantize_is_close_and_exactly_invertible(per_row):
    torch.manual_seed(0)
    w = torch.randn(48, 96) * torch.logspace(-3, 1, 48).view(48, 1)
    q, scale = quantize(w.to(DTYPE), per_row=per_row)
    assert q.dtype == FP8_DTYPE and scale.shape == ((48, 1) if per_row else (1, 1))
    # Power-of-two scales; the largest element maps into the top octave of e4m3.
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))
    amax = w.to(DTYPE).float().abs().amax(dim=1, keepdim=True)
    top = (amax / scale) if per_row else amax.amax() / scale
    assert bool(((top > FP8_MAX / 2) & (top <= FP8_MAX)).all())
    wide = dequantize(q, scale, DTYPE)
    # Widening is exact: the same in bf16 as in fp32.
    assert torch.equal(wide.float(), q.float() * scale)
    # e4m3 keeps 3 mantissa bits: each normal element within 2^-4 of itself (relative).
    normal = w.abs() >= scale * 2.0 ** -6
    rel = ((wide.float() - w.to(DTYPE).float()).abs() / w.to(DTYPE).float().abs())[normal]
    assert float(rel.max()) <= 2.0 ** -4 + 1e-6
    if per_row:
        assert bool(normal.all()), "per-row scales keep every row of this matrix in the normal range"


def test_forward_and_backward_use_the_widened_weight():
    """The FP8 layer computes what nn.Linear computes with the widened weight, both ways."""
    model = layered()
    opt = build(model)
    plain = layered()
    for slot in opt._weights.held:
        q, scale = opt._weights.device_image(slot)
        plain.get_parameter(slot.key).data.copy_(dequantize(q, scale, DTYPE))
    x, y = data(1)[0]
    for m in (model, plain):
        ((m(x).float() - y.float()) ** 2).mean().backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(model.get_parameter(name).grad, p.grad, msg=name)
    opt.close()


def test_resume_holds_the_master_and_continues_bit_for_bit():
    """The model's state dict gives the masters (never the FP8 image); a run resumed from it and
    the optimizer's checkpoint steps exactly as the uninterrupted one."""
    def run(model, opt, batches):
        for x, y in batches:
            ((model(x).float() - y.float()) ** 2).mean().backward()
            opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()

    batches = data(6)
    model = layered()
    opt = build(model, offload_gradients=True, master_dtype="fp32")
    run(model, opt, batches[:3])
    model_sd = through_a_file({k: v.clone() for k, v in model.state_dict().items()})
    opt_sd = through_a_file(opt.state_dict())
    for slot in opt._weights.held:
        assert model_sd[slot.key].dtype == DTYPE
        assert torch.equal(model_sd[slot.key], slot.step_param.to(DTYPE))
    run(model, opt, batches[3:])

    resumed = layered(seed=7)
    resumed.load_state_dict(model_sd)
    opt2 = build(resumed, offload_gradients=True, master_dtype="fp32")
    opt2.load_state_dict(opt_sd)
    assert_images_are_quantized_masters(opt2)
    run(resumed, opt2, batches[3:])
    for a, b in zip(opt._slots, opt2._slots):
        assert torch.equal(a.step_param, b.step_param), a.key
    assert_images_are_quantized_masters(opt2)


def test_loading_model_weights_after_binding_is_refused():
    model = layered()
    build(model)
    with pytest.raises(RuntimeError, match="FP8 image"):
        model.load_state_dict(layered().state_dict())


def test_per_tensor_scales():
    model = layered()
    opt = build(model, device_weights="fp8_per_tensor", offload_gradients=True)
    x, y = data(1)[0]
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    assert_images_are_quantized_masters(opt, per_row=False)


@pytest.mark.parametrize("options, match", [
    (dict(device_weights="int8"), r"optimizer\.device_weights='int8'"),
    (dict(device_weights=True), r"optimizer\.device_weights=True"),
    (dict(device_weights="fp8", update_on="device"), r"optimizer\.update_on=device with optimizer\.device_weights=fp8"),
])
def test_bad_values_name_the_key(options, match):
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer(layered().named_parameters(), minimal_size=MINIMAL_SIZE, **options)


def test_a_model_without_layers_is_refused():
    model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64)).to(DTYPE)
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE, device_weights="fp8")
    with pytest.raises(ValueError, match=r"optimizer\.device_weights=fp8: the model has no"):
        opt.register_forward_waits(model)


def test_step_before_binding_is_refused():
    model = layered()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE, device_weights="fp8")
    x, y = data(1)[0]
    ((model(x).float() - y.float()) ** 2).mean().backward()
    with pytest.raises(RuntimeError, match="register_forward_waits"):
        opt.step()


@pytest.mark.parametrize("path", list(GRADIENT_PATHS))
@pytest.mark.parametrize("clipping", [False, True])
@pytest.mark.parametrize("optimizer_class", ["torch.optim.AdamW", "torchtune_offload.AdamW8bit"])
def test_overlap_matches_serial(path, clipping, optimizer_class):
    """Overlapped host steps (two micro-batches a step) upload the same images and reach the same
    masters; with AdamW8bit and device-added sums, the shipped 8B FP8 config's path."""
    offload_gradients, grad_sum_on = GRADIENT_PATHS[path]
    results = []
    batches = data(6)
    for overlap in (False, True):
        model = layered()
        opt = build(model, optimizer_class, offload_gradients=offload_gradients, overlap=overlap,
                    grad_sum_on=grad_sum_on)
        for first, last in zip(batches[::2], batches[1::2]):
            ((model(first[0]).float() - first[1].float()) ** 2).mean().backward()
            opt.expect_final_backward(clipping=clipping)
            ((model(last[0]).float() - last[1].float()) ** 2).mean().backward()
            if clipping:
                opt.clip_grad_norm_(0.5)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        assert_images_are_quantized_masters(opt)
        results.append([copy.deepcopy(s.step_param) for s in opt._slots if s.offloaded])
        opt.close()
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_8bit_host_states_step_the_master_as_adamw8bit_alone(clip):
    """With torchtune_offload.AdamW8bit as the host optimizer, the masters equal AdamW8bit stepped
    alone on the engine's gradients, and the images follow them."""
    model = layered()
    ref = {n: nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
    ref_opt = AdamW8bit(ref.values(), lr=1e-2, weight_decay=0.1)
    tap = GradientTap(model)
    opt = build(model, optimizer_class="torchtune_offload.AdamW8bit", offload_gradients=True)
    for x, y in data(4):
        tap.clear()
        ((model(x).float() - y.float()) ** 2).mean().backward()
        for name, p in ref.items():
            p.grad = tap.sums[name]
        if clip is not None:
            assert torch.equal(opt.clip_grad_norm_(clip), torch.nn.utils.clip_grad_norm_(ref.values(), clip))
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for slot in opt._slots:
            assert torch.equal(slot.step_param if slot.offloaded else slot.param, ref[slot.key]), slot.key
        assert_images_are_quantized_masters(opt)


def test_the_host_plan_counts_the_scales_at_most_once_per_offloaded_matrix():
    model = layered()
    plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cpu", minimal_size=MINIMAL_SIZE,
                                             device_weights="fp8")
    without = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cpu", minimal_size=MINIMAL_SIZE)
    opt = build(model)
    held = sum(4 * s.param.shape[0] for s in opt._weights.held)
    # The four layer linears' rows, and the head's (offloaded, but not held: planned from shapes alone).
    assert plan.parts["FP8 scales"] == held + 4 * 80
    assert {k: v for k, v in plan.parts.items() if k != "FP8 scales"} == without.parts


@pytest.mark.streams_as_is
def test_the_checker_needs_the_upload_stream_to_wait_for_the_new_images():
    """Calibration: without the upload stream's wait for the compute stream (which allocated the
    FP8 images), the first upload races the allocation, and the checker says so."""
    for drop, raises in (((), False), ((("fp8_weights.py", "self._transfer.uploads_wait_for_compute()"),), True)):
        model = layered()
        with pytest.raises(StreamOrderError) if raises else contextlib.nullcontext():
            with checked_streams(drop_waits=drop):
                build(model, offload_gradients=True)


def test_the_fused_master_pass_feeds_the_images_too():
    """fp32 masters stepped by the fused C pass (which writes its bf16 rounding into the gradient
    buffer the image then takes): the images are the quantized masters, and the masters stay within
    the fused pass's rounding of the unfused path's."""
    runs = []
    for fused in (True, False):
        model = layered()
        opt = build(model, offload_gradients=True, master_dtype="fp32", fused_master_step=fused)
        for x, y in data(3):
            ((model(x).float() - y.float()) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
            assert_images_are_quantized_masters(opt)
        runs.append(opt)
    for a, b in zip(runs[0]._slots, runs[1]._slots):
        torch.testing.assert_close(a.step_param, b.step_param, rtol=1e-6, atol=1e-7)


def test_checkpointed_layers_never_stop_their_recomputation_inside_the_fp8_linear(monkeypatch):
    """Non-reentrant checkpointing ends a layer's recomputation early by raising from its saved-tensor
    hook; inside the FP8 linear's autograd function that exception is lost on CUDA (SystemError on
    an H100, torch 2.11). Bound models recompute whole layers instead, and get the same gradients."""
    stops = []
    original = checkpoint._StopRecomputationError.__init__

    def counting_init(self, *args):
        stops.append(1)
        original(self, *args)

    monkeypatch.setattr(checkpoint._StopRecomputationError, "__init__", counting_init)
    grads = {}
    for wrapped in (False, True):
        model = layered()
        if wrapped:
            for i, layer in enumerate(model.layers):
                model.layers[i] = checkpoint_wrapper(layer)
        opt = build(model, offload_gradients=False)
        x, y = data(1)[0]
        ((model(x).float() - y.float()) ** 2).mean().backward()
        grads[wrapped] = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone()
                          for n, p in model.named_parameters()}
        opt.close()
    assert stops == []
    # The early-stop setting is the model's forward's only: restored after it.
    assert checkpoint._enable_checkpoint_early_stop is None
    assert grads[True].keys() == grads[False].keys()
    for name, g in grads[False].items():
        assert torch.equal(grads[True][name], g), name


def test_a_forward_that_raises_still_restores_checkpoints_early_stop():
    """The whole-layer setting is the bound model's forward's only, even when that forward fails."""
    model = layered()
    opt = build(model, offload_gradients=False)
    with pytest.raises(RuntimeError):
        model(torch.zeros(6, 23, dtype=DTYPE))  # the wrong width: the first linear refuses it
    assert checkpoint._enable_checkpoint_early_stop is None
    opt.close()
