"""fp32 master weights for a bf16 model: the masters follow plain fp32 AdamW fed the same gradients,
the model's weights are their bf16 rounding, and checkpoints carry the masters."""

import functools

import pytest
import torch

from tests.optim.side_by_side import assert_same_params, batches, plain_hooks, tiny_model, train
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import fused_step
from torchtune_offload.optim.host_arena import aligned_bytes
from torchtune_offload.optim.param_table import Slot
from torchtune_offload.optim.slot_step import SlotStepper

MINIMAL_SIZE = 1000  # the three weights step on the host, the biases on the device


def _bf16_model():
    return tiny_model().to(torch.bfloat16)


def _record_fed_gradients(monkeypatch):
    """Records, per parameter, the fp32 gradient each master is fed (what plain AdamW gets below)."""
    fed = {}
    original = SlotStepper.step_slot

    def recording(self, slot: Slot, grad: torch.Tensor, *, grad_scale=None) -> None:
        # With a clipping factor the step is fed the gradient scaled as mul_ scales it.
        seen = grad if grad_scale is None else grad.mul(grad_scale)
        fed.setdefault(slot.key, []).append(seen.detach().float().cpu().clone())
        # The outer group's lr, as synced into the slot's base optimizer before each step.
        fed.setdefault("lr", {})[len(fed[slot.key]) - 1] = slot.optimizer.param_groups[0]["lr"]
        original(self, slot, grad, grad_scale=grad_scale)

    monkeypatch.setattr(SlotStepper, "step_slot", recording)
    return fed


def _plain_fp32_adamw(initial, fed, *, steps, lr_at):
    """Plain AdamW on fp32 copies of the initial weights, fed the recorded gradients."""
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in initial.items()}
    opt = torch.optim.AdamW(masters.values(), lr=lr_at(0), weight_decay=0.1)
    for i in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(i)
        for name, p in masters.items():
            p.grad = fed[name][i].to(p.device)
        opt.step()
    return masters


# fp32 sums are host sums: without offload_gradients the device sums in bf16 (refused below).
@pytest.mark.parametrize("offload_gradients, grad_sum_dtype", [(False, None), (True, None), (True, "fp32")])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
def test_masters_follow_plain_fp32_adamw(monkeypatch, grad_sum_dtype, offload_gradients, grad_accum, clip):
    fed = _record_fed_gradients(monkeypatch)
    model = _bf16_model()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32",
                           grad_sum_dtype=grad_sum_dtype, offload_gradients=offload_gradients,
                           minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=4 * grad_accum)]
    train(model, opt, data, grad_accum=grad_accum, clip=clip, scheduler=sched,
          scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
    report = opt.memory_report()
    assert report.num_offloaded == 3 and report.num_on_device == 3

    reference = _plain_fp32_adamw(initial, fed, steps=4, lr_at=lambda i: fed["lr"][i])
    for slot in opt._slots:
        assert slot.step_param.dtype == torch.float32 and slot.param.dtype == torch.bfloat16
        torch.testing.assert_close(slot.step_param.cpu(), reference[slot.key].detach(), rtol=1e-6, atol=1e-7)
        assert torch.equal(slot.param, slot.step_param.to(slot.param.device, torch.bfloat16))
        assert not torch.equal(slot.param, initial[slot.key])  # training moved it
    if grad_sum_dtype == "fp32":
        assert all(s.host_grad.dtype == torch.float32 for s in opt._slots if s.offloaded)


class _PlainMasterAdamW:
    """The plain way to train a bf16 model on fp32 masters, written independently of the engine:
    autograd sums the bf16 gradients, torch's ``clip_grad_norm_`` scales them in bf16, fp32 AdamW
    steps on their widening, and the model takes the masters' rounding."""

    def __init__(self, model, **options):
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = torch.optim.AdamW(self.masters, **options)

    @torch.no_grad()
    def step(self):
        for p, master in zip(self.params, self.masters):
            master.grad = p.grad.float()
        self.inner.step()
        for p, master in zip(self.params, self.masters):
            p.copy_(master)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("fused_master_step", [False, True], ids=["unfused", "fused pass"])
def test_masters_follow_plain_master_training_of_the_bf16_model(offload_gradients, grad_accum, clip,
                                                                 fused_master_step):
    """Against an independent reference (not the gradients the engine fed itself): the same bf16
    model trained plainly on fp32 masters, with a cosine schedule. The unfused path is the same
    operations, so the same bits; the fused pass rounds its multiply-adds in another order."""
    if fused_master_step and fused_step.c_compiler() is None:
        pytest.skip("no C compiler to build the fused pass")
    ref_model = _bf16_model()
    model = _bf16_model()
    ref = _PlainMasterAdamW(ref_model, lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32",
                           offload_gradients=offload_gradients, fused_master_step=fused_master_step,
                           minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=4 * grad_accum)]
    ref_scale, ref_clip = plain_hooks(ref_model)
    ref_norms = train(ref_model, ref, data, grad_accum=grad_accum, clip=clip,
                      scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(ref.inner, T_max=4),
                      scale_grads=ref_scale, clip_grads=ref_clip)
    norms = train(model, opt, data, grad_accum=grad_accum, clip=clip,
                  scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
                  scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
    assert norms == ref_norms
    if clip is not None:
        assert max(norms) > clip, "the clip threshold must bite"
    tolerance = dict(rtol=1e-6, atol=1e-7) if fused_master_step else dict(rtol=0, atol=0)
    assert sum(s.offloaded for s in opt._slots) == 3
    for slot, master in zip(opt._slots, ref.masters):
        torch.testing.assert_close(slot.step_param, master.detach(), **tolerance)
    if not fused_master_step:
        assert_same_params(ref_model, model, rtol=0, atol=0)
    opt.close()


def test_small_updates_survive_in_the_master_and_are_lost_without_it():
    # An update far below bf16's resolution at 1.0 (2**-8): pure bf16 AdamW rounds it away.
    def run(master_dtype):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = OffloadOptimizer([("w", p)], "torch.optim.SGD", master_dtype=master_dtype, lr=1e-4)
        for _ in range(100):
            p.grad = torch.ones_like(p)
            opt.step()
            opt.zero_grad()
        return p
    assert torch.equal(run(None), torch.ones(4096, dtype=torch.bfloat16))  # 100 steps of 1e-4 lost
    # With the master: 1 - 100 * 1e-4 = 0.99, which bf16 represents as 0.98828125 or 0.9921875.
    assert run("fp32").float().sub(0.99).abs().max() < 2**-8


def test_checkpoint_carries_the_masters_and_resumes_exactly():
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=6)]

    def make():
        model = _bf16_model()
        return model, OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32",
                                       minimal_size=MINIMAL_SIZE, lr=1e-2)

    noop = lambda f: None  # noqa: E731
    straight_model, straight = make()
    train(straight_model, straight, data, grad_accum=1, clip=None, scale_grads=noop, clip_grads=None)

    first_model, first = make()
    train(first_model, first, data[:3], grad_accum=1, clip=None, scale_grads=noop, clip_grads=None)
    saved = first.state_dict()
    assert all(entry["master"].dtype == torch.float32 for entry in saved["state"].values())
    resumed_model, resumed = make()
    resumed_model.load_state_dict(first_model.state_dict())
    resumed.load_state_dict(saved)
    train(resumed_model, resumed, data[3:], grad_accum=1, clip=None, scale_grads=noop, clip_grads=None)
    for a, b in zip(resumed._slots, straight._slots):
        assert torch.equal(a.step_param, b.step_param) and torch.equal(a.param, b.param)

    # A checkpoint without masters does not load into an optimizer with them, and says why.
    plain_model = _bf16_model()
    plain = OffloadOptimizer(plain_model.named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE, lr=1e-2)
    with pytest.raises(ValueError, match="master weights"):
        make()[1].load_state_dict(plain.state_dict())


@pytest.mark.parametrize("key", ["master_dtype", "grad_sum_dtype"])
def test_only_fp32_or_unset_is_accepted(key):
    with pytest.raises(ValueError, match=f"optimizer.{key}='fp16': use fp32"):
        OffloadOptimizer(_bf16_model().named_parameters(), **{key: "fp16"})


def test_fp32_sums_without_offload_gradients_are_refused_by_name():
    """Without offload_gradients the device sums the micro-batches in bf16 and clipping scales them
    there: an fp32 host buffer would hold a widened copy at twice the bytes, and an overlapped
    step scaled it in fp32 where the serial one scales in bf16 (the two runs' weights differed)."""
    for make in (OffloadOptimizer, functools.partial(OffloadOptimizer.plan_host_memory, device="cpu")):
        with pytest.raises(ValueError, match=r"optimizer\.grad_sum_dtype=fp32 without optimizer\.offload_gradients="
                                             r"True: .* remove it \(~optimizer\.grad_sum_dtype\)"):
            make(_bf16_model().named_parameters(), master_dtype="fp32", grad_sum_dtype="fp32", overlap=True)


def test_plan_counts_fp32_masters_and_states():
    model = _bf16_model().to("meta")
    plan = OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cpu", master_dtype="fp32",
                                             grad_sum_dtype="fp32", offload_gradients=True, minimal_size=MINIMAL_SIZE,
                                             lr=1.0)
    real = OffloadOptimizer(_bf16_model().named_parameters(), master_dtype="fp32", grad_sum_dtype="fp32",
                            offload_gradients=True, minimal_size=MINIMAL_SIZE, lr=1.0)
    big = [p for p in model.parameters() if p.numel() >= MINIMAL_SIZE]
    n = sum(p.numel() for p in big)

    def carved(width):  # each buffer starts on a page of the engine's host block
        return sum(aligned_bytes(width * p.numel()) for p in big)

    assert plan.parts == {"parameter copies": carved(4), "gradient buffers": carved(4),
                          "device-dtype copies": carved(2), "optimizer state": 8 * n + 4 * len(big)}
    for slot in real._slots:
        if slot.offloaded:
            slot.step_param.grad = torch.zeros_like(slot.step_param)
            slot.optimizer.step()
    assert real.memory_report().host_bytes == plan.total


@pytest.mark.skipif(fused_step.c_compiler() is None, reason="no C compiler for the fused pass")
def test_the_fused_pass_runs_and_agrees_with_the_unfused_path(monkeypatch):
    fused_calls = []
    original = fused_step.fused_adamw_step

    def counting(*args, **kwargs):
        fused_calls.append(original(*args, **kwargs))
        return fused_calls[-1]

    monkeypatch.setattr(fused_step, "fused_adamw_step", counting)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=4)]
    noop = lambda f: None  # noqa: E731
    runs = {}
    for fused in (True, False):
        model = _bf16_model()
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32",
                               fused_master_step=fused, minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
        train(model, opt, data, grad_accum=1, clip=None, scale_grads=noop, clip_grads=None)
        runs[fused] = opt
    assert fused_calls == [True] * (4 * 3)  # every offloaded master, every step, compiled
    for a, b in zip(runs[True]._slots, runs[False]._slots):
        torch.testing.assert_close(a.step_param, b.step_param, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(a.optimizer.state[a.step_param][key], b.optimizer.state[b.step_param][key],
                                       rtol=1e-4, atol=1e-8)  # fused multiply-adds round differently
        assert float(a.optimizer.state[a.step_param]["step"]) == float(b.optimizer.state[b.step_param]["step"]) == 4


def test_after_a_step_the_reused_gradient_buffer_is_not_taken_for_a_gradient():
    # master fp32, bf16 gradient buffers: the step writes the rounded weights over the gradient.
    model = _bf16_model()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", master_dtype="fp32",
                           offload_gradients=True, minimal_size=MINIMAL_SIZE, lr=1e-2)
    (x, y), = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=1)]
    ((model(x) - y) ** 2).sum().backward()
    assert opt.grad_norm() > 0
    opt.step()
    offloaded = [s for s in opt._slots if s.offloaded]
    assert all(s.out is s.host_grad and not opt._grads.holds(s) for s in offloaded)
    opt.zero_grad(set_to_none=False)  # must not zero the buffer the new weights are copied from
    assert all(torch.equal(s.host_grad, s.param.detach()) for s in offloaded)
    # A backward without zero_grad starts a fresh host sum instead of adding onto the weights.
    ((model(x) - y) ** 2).sum().backward()
    opt.grad_norm()  # the host sums are read once their copies have landed (as on a GPU)
    grads = {s.key: s.host_grad.clone() for s in offloaded}
    reference = _bf16_model()
    reference.load_state_dict(model.state_dict())
    ((reference(x) - y) ** 2).sum().backward()
    for s in offloaded:
        assert torch.equal(grads[s.key], dict(reference.named_parameters())[s.key].grad)


def test_adam_with_decoupled_weight_decay_takes_adamw_math_in_the_fused_pass():
    def masters(cls, **extra):
        model = _bf16_model()
        opt = OffloadOptimizer(model.named_parameters(), cls, master_dtype="fp32", minimal_size=MINIMAL_SIZE,
                               lr=1e-2, weight_decay=0.1, **extra)
        noop = lambda f: None  # noqa: E731
        train(model, opt, [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=3)], grad_accum=1, clip=None,
              scale_grads=noop, clip_grads=None)
        return [s.step_param for s in opt._slots]

    if "decoupled_weight_decay" not in torch.optim.Adam.__init__.__code__.co_varnames:
        pytest.skip("this torch's Adam has no decoupled_weight_decay")
    for a, b in zip(masters("torch.optim.Adam", decoupled_weight_decay=True), masters("torch.optim.AdamW")):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
