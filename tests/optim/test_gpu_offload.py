"""The offload optimizers on a real accelerator. Skipped on CPU-only machines (marker ``gpu``)."""

import pytest
import torch
from torch import nn

from tests.optim.side_by_side import assert_same_params, batches, plain_hooks, tiny_model, train, twin
from tests.optim.test_overlap import offload, train_windows
from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.optim.staging import DeviceSumRing

pytestmark = pytest.mark.gpu
MINIMAL_SIZE = 1000


def _device():
    return str(torch.accelerator.current_accelerator())


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_offload_optimizer_matches_plain_adamw(offload_gradients, grad_accum, clip):
    device = _device()
    ref = tiny_model(device=device)
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(
        model.named_parameters(), "torch.optim.AdamW", offload_gradients=offload_gradients,
        minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1,
    )
    assert all(s.step_param.is_pinned() for s in opt._slots if s.offloaded)
    data = batches(num=5 * grad_accum, device=device)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(ref_opt, T_max=5)
    ref_norms = train(ref, ref_opt, data, grad_accum=grad_accum, clip=clip, scheduler=sched,
                      scale_grads=plain_hooks(ref)[0], clip_grads=plain_hooks(ref)[1])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    norms = train(model, opt, data, grad_accum=grad_accum, clip=clip, scheduler=sched,
                  scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
    # Host fused AdamW against device foreach AdamW: same math, another summation order.
    assert_same_params(ref, model, rtol=1e-5, atol=1e-5)
    assert norms == pytest.approx(ref_norms, rel=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("ring", ["default", "tiny"])
@pytest.mark.parametrize("dtype,grad_sum_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                  (torch.bfloat16, "fp32")])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_sums_added_on_the_device_equal_the_host_rings_bit_for_bit(overlap, ring, dtype, grad_sum_dtype, clip):
    """grad_sum_on=device on real streams: the sums go up, are added by the device and come back
    down; a tiny ring (64-byte chunks) splits every gradient and reuses each chunk many times.
    Without clipping the runs are the same bits. With clipping the device ring's sums are still the
    host ring's bits, but their norms are the device's reduction (DeviceSumRing.add_many_and_measure)
    against the host's, so the clipped runs agree to rounding."""
    device = _device()
    base = tiny_model(device=device).to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=9, device=device)]
    runs = {}
    for where in ("host", "device"):
        model = twin(base)
        opt = offload(model, overlap=overlap, offload_gradients=True, grad_sum_on=where, grad_sum_dtype=grad_sum_dtype)
        if where == "device" and ring == "tiny":
            opt._grads.staging = DeviceSumRing(opt._transfer, device=opt.device, chunk_bytes=64, num_chunks=3)
        runs[where] = (model, train_windows(model, opt, data, grad_accum=3, clip=clip))
        opt.close()
    if clip is None:
        assert_same_params(runs["host"][0], runs["device"][0], rtol=0, atol=0)
    else:
        rtol = 1e-5 if dtype == torch.float32 else 2e-2
        assert runs["device"][1] == pytest.approx(runs["host"][1], rel=rtol) and max(runs["host"][1]) > clip
        assert_same_params(runs["host"][0], runs["device"][0], rtol=rtol, atol=rtol)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_torchao_wrapper_matches_plain_adamw_where_defined(offload_gradients):
    # torchao's optimizer cannot clip, and cannot accumulate with offloaded gradients: the
    # comparison is made where its math is defined, with gradients normalised before backward.
    device = _device()
    ref = tiny_model(device=device)
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = CPUOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW",
                              offload_gradients=offload_gradients, minimal_size=MINIMAL_SIZE, lr=1e-2)
    grad_accum = 1 if offload_gradients else 2
    data = batches(num=4 * grad_accum, device=device)
    noop = lambda f: None  # noqa: E731
    for m, o in ((ref, ref_opt), (model, opt)):
        train(m, o, [(x, y / grad_accum**0.5) for x, y in data], grad_accum=grad_accum, clip=None,
              scale_grads=noop, clip_grads=None)
    assert_same_params(ref, model, rtol=1e-5, atol=1e-5)


def test_device_memory_drops_by_the_optimizer_state():
    device = _device()
    torch.manual_seed(0)

    def peak(opt_factory):
        model = nn.Sequential(*[nn.Linear(1024, 1024, bias=False) for _ in range(8)]).to(device)
        opt = opt_factory(model)
        torch.accelerator.synchronize()
        torch.accelerator.reset_peak_memory_stats()
        x = torch.randn(16, 1024, device=device)
        for _ in range(2):
            model(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
        torch.accelerator.synchronize()
        return torch.accelerator.max_memory_allocated()

    plain = peak(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    offloaded = peak(lambda m: OffloadOptimizer(m.named_parameters(), lr=1e-3))
    state_bytes = 2 * 8 * 1024 * 1024 * 4  # exp_avg + exp_avg_sq, fp32
    assert plain - offloaded >= 0.9 * state_bytes


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("master_dtype", [None, "fp32"])
def test_overlap_on_the_accelerator_gives_the_serial_results(offload_gradients, grad_accum, clip, master_dtype):
    """Real streams, events and pinned buffers: the overlapped run equals the serial one bit for bit."""
    from tests.optim.test_overlap import train_windows

    device = _device()
    dtype = torch.bfloat16 if master_dtype else torch.float32
    base = tiny_model(device=device).to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=5 * grad_accum, device=device)]
    models = {}
    for overlap in (False, True):
        model = twin(base)
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=offload_gradients,
                               minimal_size=MINIMAL_SIZE, master_dtype=master_dtype, overlap=overlap,
                               lr=1e-2, weight_decay=0.1)
        opt.register_forward_waits(model)
        train_windows(model, opt, data, grad_accum=grad_accum, clip=clip,
                      scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5))
        opt.close()
        models[overlap] = model
    for a, b in zip(models[False].parameters(), models[True].parameters()):
        assert torch.equal(a, b)


def test_overlap_stress_on_the_accelerator():
    """Many small parameters, all on the host path, 20 runs: a missing stream wait shows as a wrong weight."""
    from tests.optim.test_overlap import _many_small, train_windows

    device = _device()
    for run in range(20):
        offload_gradients, grad_accum, clip = bool(run % 2), 1 + 2 * (run // 2 % 2), (None, 0.05)[run // 4 % 2]
        base = _many_small(run).to(device)
        g = torch.Generator().manual_seed(run)
        data = [(torch.randn(4, 6, generator=g).to(device), torch.randn(4, 3, generator=g).to(device))
                for _ in range(4 * grad_accum)]
        ref = twin(base)
        ref_opt = OffloadOptimizer(ref.named_parameters(), minimal_size=0, offload_gradients=offload_gradients,
                                   lr=1e-2, weight_decay=0.1)
        train_windows(ref, ref_opt, data, grad_accum=grad_accum, clip=clip)
        model = twin(base)
        opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=offload_gradients,
                               overlap=True, lr=1e-2, weight_decay=0.1)
        opt.register_forward_waits(model)
        train_windows(model, opt, data, grad_accum=grad_accum, clip=clip)
        opt.close()
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b), f"run {run}"


@pytest.mark.parametrize("master_dtype", [None, "fp32"])
def test_host_buffers_are_pinned_at_their_planned_size(master_dtype):
    device = _device()
    model = tiny_model(device=device).bfloat16()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype=master_dtype,
                           minimal_size=MINIMAL_SIZE, lr=1e-2)
    offloaded = [s for s in opt._slots if s.offloaded]
    assert all(t.is_pinned() for s in offloaded for t in s.host_buffers)
    plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device=device, master_dtype=master_dtype,
                                             minimal_size=MINIMAL_SIZE, lr=1e-2)
    assert opt.memory_report().pinned_bytes == sum(v for k, v in plan.parts.items() if k.endswith("(pinned)"))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_device_update_matches_plain_adamw_bit_for_bit(overlap, grad_accum, clip):
    """update_on=device runs plain AdamW's own device kernel (foreach) on staged slices: the same bits,
    with the states in pinned host memory and a staging area smaller than the largest weight."""
    device = _device()
    ref = tiny_model(device=device)
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", update_on="device", overlap=overlap,
                           device_staging_mib=16 / 1024, minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
    if overlap:
        opt.register_forward_waits(model)
    assert all(len(opt._streamer.slices(s)) > 1 for s in opt._slots if s.streamed)
    data = batches(num=5 * grad_accum, device=device)
    ref_norms = train(ref, ref_opt, data, grad_accum=grad_accum, clip=clip,
                      scale_grads=plain_hooks(ref)[0], clip_grads=plain_hooks(ref)[1])
    norms = train(model, opt, data, grad_accum=grad_accum, clip=clip, scale_grads=opt.scale_grads_,
                  clip_grads=opt.clip_grad_norm_)
    opt.synchronize()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert norms == ref_norms
    for slot, p in zip(opt._slots, ref.parameters()):
        if slot.streamed:
            state = slot.optimizer.state[slot.param]
            assert all(state[k].is_pinned() and torch.equal(state[k], v.cpu())
                       for k, v in ref_opt.state[p].items() if k != "step")
    report = opt.memory_report()
    assert 0 < report.device_staging_bytes <= 16 * 1024 and report.pinned_bytes == report.host_bytes
