"""Overlapped host steps (``OffloadOptimizer(overlap=True)``) give the serial path's results.

Two copies of a tiny model train side by side, the way the recipes train: the loss is divided by
the window size before backward, the window's last backward is announced, then clip and step.
The CPU emulation runs the real pipeline (worker threads, futures, per-module waits), so a missing
wait shows up here as a wrong weight; the stress test widens every race with random delays.
"""

import random
import threading
import time
from typing import List, Optional

import pytest
import torch
from torch import nn

from tests.concurrency import FirstWaitsForASecond
from tests.optim.side_by_side import assert_same_params, batches, through_a_file, tiny_model, twin
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import host_grads, overlap_scheduler, slot_step
from torchtune_offload.optim.overlap import HostWorkers
from torchtune_offload.optim.transfer import TransferEngine
from torchtune_offload.optim.slot_step import SlotStepper

MINIMAL_SIZE = 1000  # weights step on the host, biases on the device


def train_windows(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: List[tuple],
    *,
    grad_accum: int,
    clip: Optional[float],
    scheduler=None,
    announce: bool = True,
    timings: Optional[List[dict]] = None,
) -> List[float]:
    """Trains len(data) // grad_accum windows; returns the norms clipping saw (and appends our
    optimizer's ``step_timings()`` after each step to ``timings``, if given)."""
    norms = []
    ours = isinstance(opt, OffloadOptimizer)
    for start in range(0, len(data) - grad_accum + 1, grad_accum):
        window = data[start : start + grad_accum]
        for i, (x, y) in enumerate(window):
            loss = ((model(x) - y) ** 2).sum() / grad_accum
            if ours and announce and i == len(window) - 1:
                opt.expect_final_backward(clipping=clip is not None)
            loss.backward()
        if clip is not None:
            clip_fn = opt.clip_grad_norm_ if ours else (
                lambda c: torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], c))
            norms.append(float(clip_fn(clip)))
        opt.step()
        if timings is not None and ours:
            timings.append(opt.step_timings())
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
    return norms


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-4)


def offload(model, *, overlap: bool, forward_waits: bool = True, **kwargs) -> OffloadOptimizer:
    options = dict(minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", overlap=overlap, **{**options, **kwargs})
    if forward_waits:
        opt.register_forward_waits(model)
    return opt


#: (parameter dtype, master_dtype): fp32 training, pure bf16 (the shipped 8B configs), bf16 with masters.
PRECISIONS = {"fp32": (torch.float32, None), "bf16": (torch.bfloat16, None),
              "bf16, fp32 masters": (torch.bfloat16, "fp32")}


@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("with_scheduler", [False, True])
def test_overlap_gives_the_serial_results(precision, offload_gradients, grad_accum, clip, with_scheduler):
    dtype, master_dtype = PRECISIONS[precision]
    base = tiny_model().to(dtype)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=5 * grad_accum)]
    runs, timings = {}, []
    for overlap in (False, True):
        model = twin(base)
        opt = offload(model, overlap=overlap, offload_gradients=offload_gradients, master_dtype=master_dtype)
        norms = train_windows(model, opt, data, grad_accum=grad_accum, clip=clip,
                              scheduler=cosine(opt) if with_scheduler else None, timings=timings if overlap else None)
        opt.synchronize()
        runs[overlap] = (model, norms, opt)
    serial, overlapped = runs[False], runs[True]
    # The same operations on the same tensors: the same bits.
    assert_same_params(serial[0], overlapped[0], rtol=0, atol=0)  # bit-identical
    assert overlapped[1] == serial[1]
    # Each step() reports the host steps finished since the one before; with overlap a window's
    # steps may all finish before, or after, its own step(), so one step's figure may be 0.
    assert sum(t["host_step_s"] for t in timings) > 0
    if master_dtype is None:
        # Plain AdamW in the same dtype: the same operations on each tensor, so in bf16 (where a
        # differing rounding would show at once) the same bits.
        ref = twin(base)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        ref_norms = train_windows(ref, ref_opt, data, grad_accum=grad_accum, clip=clip,
                                  scheduler=cosine(ref_opt) if with_scheduler else None)
        if dtype == torch.bfloat16:
            assert_same_params(ref, overlapped[0], rtol=0, atol=0)
        else:
            assert_same_params(ref, overlapped[0])
        assert overlapped[1] == pytest.approx(ref_norms, rel=1e-6)
        if clip is not None:
            assert max(ref_norms) > clip, "the clip threshold must bite for this test to mean anything"


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_serial_and_overlapped_clip_measure_the_same_norms(grad_accum):
    """Where the window's whole gradient is on the device, both paths measure its norm there
    before it leaves (on a GPU the host would reduce in another order; here an fp32 host sum of
    bf16 gradients makes the place visible), and clip to the same bits."""
    base = tiny_model().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(num=4 * grad_accum)]
    runs = {}
    for overlap in (False, True):
        model = twin(base)
        opt = offload(model, overlap=overlap, offload_gradients=True, grad_sum_dtype="fp32")
        runs[overlap] = (model, train_windows(model, opt, data, grad_accum=grad_accum, clip=0.5))
        opt.close()
    assert runs[False][1] == runs[True][1]
    assert max(runs[False][1]) > 0.5
    assert_same_params(runs[False][0], runs[True][0], rtol=0, atol=0)  # bit-identical


def test_the_window_sums_land_and_are_measured_side_by_side(monkeypatch):
    """The host ring's sums are measured on the host as they land (torch's CPU norm uses one core:
    2.4 s a step for the 8B's sums on the H100's host, one after another). Several landing threads
    measure them at once: the first norm waits for a second to start beside it, which one landing
    thread would never do; and the clipped run is still plain AdamW's, bit for bit."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # how many land at once
    monkeypatch.setattr(overlap_scheduler, "LANDING_BYTES", 1)  # a landing job per gradient
    probe, original = FirstWaitsForASecond(), host_grads.tensor_norms

    def spy(grads):
        if threading.current_thread().name.startswith("offload-landing"):  # not the hooks' device norms
            probe()
        return original(grads)

    monkeypatch.setattr(host_grads, "tensor_norms", spy)
    ref = tiny_model()
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = offload(model, overlap=True, offload_gradients=True)
    data = batches(num=6)
    norms = train_windows(model, opt, data, grad_accum=3, clip=0.5)
    opt.close()
    ref_norms = train_windows(ref, ref_opt, data, grad_accum=3, clip=0.5)
    assert probe.saw_a_second is True
    assert norms == ref_norms and max(norms) > 0.5
    assert_same_params(ref, model, rtol=0, atol=0)


class _Branchy(nn.Module):
    """``b`` is used only when asked: a parameter the window's last backward does not reach."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(48, 48), nn.Linear(48, 48)

    def forward(self, x, use_b):
        return self.b(self.a(x)) if use_b else self.a(x)


@pytest.mark.parametrize("grad_sum_dtype", [None, "fp32"])
def test_a_parameter_only_earlier_micro_batches_reach_clips_alike(grad_sum_dtype):
    torch.manual_seed(0)
    base = _Branchy().to(torch.bfloat16)
    data = [torch.randn(8, 48, dtype=torch.bfloat16) for _ in range(6)]
    runs = {}
    for overlap in (False, True):
        model = twin(base)
        opt = offload(model, overlap=overlap, offload_gradients=True, grad_sum_dtype=grad_sum_dtype)
        norms = []
        for start in range(0, len(data), 2):
            for i, x in enumerate(data[start : start + 2]):
                if i == 1:
                    opt.expect_final_backward(clipping=True)
                (model(x, use_b=i == 0) ** 2).sum().backward()
            norms.append(float(opt.clip_grad_norm_(0.5)))
            opt.step()
            opt.zero_grad()
        opt.close()
        runs[overlap] = (model, norms)
    assert runs[False][1] == runs[True][1] and max(runs[False][1]) > 0.5
    assert_same_params(runs[False][0], runs[True][0], rtol=0, atol=0)  # bit-identical


@pytest.mark.parametrize("dtype, options", [
    (torch.float32, dict(offload_gradients=False)),
    (torch.float32, dict(offload_gradients=True)),
    (torch.bfloat16, dict(offload_gradients=False, master_dtype="fp32")),
    (torch.bfloat16, dict(offload_gradients=True, master_dtype="fp32")),
    (torch.bfloat16, dict(offload_gradients=True, grad_sum_on="device")),
    (torch.bfloat16, dict(offload_gradients=True, grad_sum_dtype="fp32", master_dtype="fp32", grad_sum_on="device")),
    (torch.bfloat16, dict(offload_gradients=True, grad_sum_dtype="fp32")),
], ids=["fp32", "fp32, offload_gradients", "bf16, masters", "bf16, masters, offload_gradients",
        "bf16, device-added sums", "bf16, fp32 sums and masters, device-added", "bf16, fp32 sums"])
def test_overlapped_resume_is_bit_identical(dtype, options):
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=12)]
    kwargs = dict(overlap=True, **options)

    straight = tiny_model().to(dtype)
    opt = offload(straight, **kwargs)
    sched = cosine(opt)
    train_windows(straight, opt, data, grad_accum=2, clip=0.5, scheduler=sched)
    opt.synchronize()

    first = tiny_model().to(dtype)
    opt = offload(first, **kwargs)
    sched = cosine(opt)
    train_windows(first, opt, data[:6], grad_accum=2, clip=0.5, scheduler=sched)
    # Neither call is preceded by synchronize(): both wait for the queued host steps themselves.
    ckpt = through_a_file({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})

    resumed = tiny_model(seed=123).to(dtype)
    resumed.load_state_dict(ckpt["model"])
    opt = offload(resumed, **{**kwargs, "lr": 5.0})
    sched = cosine(opt)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    train_windows(resumed, opt, data[6:], grad_accum=2, clip=0.5, scheduler=sched)
    opt.synchronize()
    assert_same_params(straight, resumed, rtol=0, atol=0)  # bit-identical


@pytest.mark.parametrize("dtype, saved_with, resumed_with", [
    (torch.bfloat16, dict(offload_gradients=True), dict(offload_gradients=True, overlap=True, grad_sum_on="device")),
    (torch.bfloat16, dict(offload_gradients=True, overlap=True, grad_sum_on="device"), dict()),
    (torch.bfloat16, dict(master_dtype="fp32"), dict(master_dtype="fp32", offload_gradients=True, overlap=True)),
    (torch.bfloat16, dict(master_dtype="fp32", offload_gradients=True, grad_sum_dtype="fp32", overlap=True),
     dict(master_dtype="fp32", offload_gradients=True, grad_sum_dtype="fp32", grad_sum_on="device")),
], ids=["serial host sums -> overlapped device sums", "overlapped device sums -> serial on the device",
        "masters, serial -> overlapped offload_gradients", "fp32 sums and masters, host ring -> device ring"])
def test_resume_with_other_engine_options_is_the_straight_runs_bits(dtype, saved_with, resumed_with):
    """The checkpoint holds states by parameter name, not how gradients travel: a run may resume
    with overlap, offload_gradients or grad_sum_on changed (a setting that changes no arithmetic)
    and continue as the run that never stopped."""
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=12)]

    def run(model, options, windows, *, resume_from=None):
        opt = offload(model, overlap=options.get("overlap", False), **{k: v for k, v in options.items()
                                                                       if k != "overlap"})
        sched = cosine(opt)
        if resume_from is not None:
            opt.load_state_dict(resume_from["opt"])
            sched.load_state_dict(resume_from["sched"])
        norms = train_windows(model, opt, windows, grad_accum=2, clip=0.5, scheduler=sched)
        opt.synchronize()
        return opt, sched, norms

    straight = tiny_model().to(dtype)
    _, _, straight_norms = run(straight, saved_with, data)
    first = tiny_model().to(dtype)
    opt, sched, _ = run(first, saved_with, data[:6])
    ckpt = through_a_file({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})
    resumed = tiny_model(seed=123).to(dtype)
    resumed.load_state_dict(ckpt["model"])
    _, _, resumed_norms = run(resumed, resumed_with, data[6:], resume_from=ckpt)
    assert resumed_norms == straight_norms[3:] and max(straight_norms) > 0.5
    assert_same_params(straight, resumed, rtol=0, atol=0)  # bit-identical


def test_without_forward_waits_step_waits_and_results_match():
    base, data = tiny_model(), batches(num=6)
    ref, model = twin(base), twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = offload(model, overlap=True, forward_waits=False)
    train_windows(ref, ref_opt, data, grad_accum=2, clip=None)
    train_windows(model, opt, data, grad_accum=2, clip=None)
    assert all(opt._scheduler.pending(s) is None for s in opt._slots)
    assert_same_params(ref, model)


def test_unannounced_windows_take_the_serial_path():
    base, data = tiny_model(), batches(num=6)
    ref, model = twin(base), twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = offload(model, overlap=True, offload_gradients=True, lr=1e-2, weight_decay=0.01)
    train_windows(ref, ref_opt, data, grad_accum=3, clip=0.5)
    train_windows(model, opt, data, grad_accum=3, clip=0.5, announce=False)
    assert opt._scheduler.workers is None, "no window was announced, so no host work may have been queued"
    assert_same_params(ref, model)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_announced_and_unannounced_windows_mixed_clip_as_adamw(offload_gradients):
    """A norm measured in an announced window (for a parameter left on the device too) is not
    reused by an unannounced window after it."""
    base, data = tiny_model(), batches(num=6)
    ref, model = twin(base), twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = offload(model, overlap=True, offload_gradients=offload_gradients)
    ref_norms, norms = [], []
    for i, window in enumerate(data[k : k + 1] for k in range(len(data))):
        ref_norms += train_windows(ref, ref_opt, window, grad_accum=1, clip=0.5)
        norms += train_windows(model, opt, window, grad_accum=1, clip=0.5, announce=i % 2 == 0)
    opt.close()
    assert max(ref_norms) > 0.5, "the clip threshold must bite for this test to mean anything"
    torch.testing.assert_close(norms, ref_norms)
    assert_same_params(ref, model)


class _Delays:
    """Random sleeps in every copy and host step, to widen the windows of any missing wait."""

    def __init__(self, monkeypatch, *, seed: int, max_s: float = 2e-3) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.max_s = max_s
        # Every copy down goes through to_host_many (to_host calls it), every upload through to_device_many.
        for name in ("to_host_many", "to_device_many"):
            self._wrap(monkeypatch, TransferEngine, name)
        self._wrap(monkeypatch, SlotStepper, "_step_on_host")  # every host step, a run or one slot

    def _sleep(self) -> None:
        with self._lock:
            seconds = self._rng.uniform(0, self.max_s)
        time.sleep(seconds)

    def _wrap(self, monkeypatch, cls, name):
        original = getattr(cls, name)

        def delayed(*args, **kwargs):
            self._sleep()
            result = original(*args, **kwargs)
            self._sleep()
            return result

        monkeypatch.setattr(cls, name, delayed)


def _many_small(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(24):
        layers += [nn.Linear(12, 12), nn.Tanh()]
    return nn.Sequential(nn.Linear(6, 12), *layers, nn.Linear(12, 3))


@pytest.mark.parametrize("run", range(20))
def test_stress_many_small_parameters_with_random_delays(monkeypatch, run):
    """20 runs in a row, each with other delays and another corner of the matrix (every third with
    each module a host step of its own, as modules over STEP_JOB_BYTES go)."""
    offload_gradients, grad_accum, clip = bool(run % 2), 1 + 2 * (run // 2 % 2), (None, 0.05)[run // 4 % 2]
    if run % 3 == 0:
        monkeypatch.setattr(slot_step, "STEP_JOB_BYTES", 0)
    base = _many_small(run)
    g = torch.Generator().manual_seed(run)
    data = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(4 * grad_accum)]
    ref = twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_norms = train_windows(ref, ref_opt, data, grad_accum=grad_accum, clip=clip)

    _Delays(monkeypatch, seed=run)
    model = twin(base)
    # minimal_size=0: every parameter, bias included, steps on the host through the workers.
    opt = offload(model, overlap=True, minimal_size=0, offload_gradients=offload_gradients)
    norms = train_windows(model, opt, data, grad_accum=grad_accum, clip=clip)
    opt.close()
    assert_same_params(ref, model)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    if clip is not None:
        assert max(ref_norms) > clip


def test_step_returns_before_the_host_steps_end(monkeypatch):
    _Delays(monkeypatch, seed=0, max_s=0.02)
    model = tiny_model()
    opt = offload(model, overlap=True)
    x, y = batches(num=1)[0]
    opt.expect_final_backward(clipping=False)
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    pending = [s for s in opt._slots if opt._scheduler.pending(s) is not None and not opt._scheduler.pending(s).done()]
    assert pending, "step() waited for every host step"
    model(x)  # the forward waits for each module's own parameters
    assert all(opt._scheduler.pending(s) is None for s in opt._slots)
    assert opt.step_timings()["host_step_s"] >= 0


def test_worker_errors_reach_the_caller(monkeypatch):
    model = tiny_model()
    opt = offload(model, overlap=True)
    x, y = batches(num=1)[0]

    def broken(self, slots, stepped, **_):
        raise ValueError(f"host step failed for {slots[0].key}")

    monkeypatch.setattr(SlotStepper, "_step_on_host", broken)
    opt.expect_final_backward(clipping=False)
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="host step failed"):
        model(x)


def test_a_stuck_host_step_times_out_with_a_clear_error(monkeypatch):
    model = tiny_model()
    opt = offload(model, overlap=True, overlap_timeout_s=0.05)
    x, y = batches(num=1)[0]
    release = threading.Event()
    original = SlotStepper._step_on_host

    def stuck(self, slots, stepped, **kwargs):
        release.wait(timeout=30)
        original(self, slots, stepped, **kwargs)

    monkeypatch.setattr(SlotStepper, "_step_on_host", stuck)
    opt.expect_final_backward(clipping=False)
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"host step.*overlap_timeout_s"):
        model(x)
    release.set()
    opt.close()


@pytest.mark.parametrize("bad", [0, -1.0, "soon", True])
def test_a_bad_overlap_timeout_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match="optimizer.overlap_timeout_s"):
        offload(tiny_model(), overlap=True, overlap_timeout_s=bad)


def test_misuse_of_an_announced_window_is_refused():
    model = tiny_model()
    opt = offload(model, overlap=True)
    x, y = batches(num=1)[0]
    opt.expect_final_backward(clipping=False)
    with pytest.raises(RuntimeError, match="twice"):
        opt.expect_final_backward(clipping=False)
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match="clipping=True"):
        opt.clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="Scale the loss"):
        opt.scale_grads_(0.5)
    with pytest.raises(RuntimeError, match="step\\(\\) first"):
        opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match="lr"):
        opt.step()


def test_a_second_backward_after_the_announcement_is_refused():
    model = tiny_model()
    opt = offload(model, overlap=True)
    x, y = batches(num=1)[0]
    opt.expect_final_backward(clipping=True)
    ((model(x) - y) ** 2).sum().backward()
    with pytest.raises(RuntimeError, match="second backward"):
        ((model(x) - y) ** 2).sum().backward()


def test_announcing_without_overlap_does_nothing():
    base, data = tiny_model(), batches(num=4)
    ref, model = twin(base), twin(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = offload(model, overlap=False)
    train_windows(ref, ref_opt, data, grad_accum=2, clip=0.5)
    train_windows(model, opt, data, grad_accum=2, clip=0.5)
    assert opt._scheduler.workers is None
    assert_same_params(ref, model)


def test_bad_overlap_value():
    with pytest.raises(ValueError, match="optimizer.overlap"):
        OffloadOptimizer(tiny_model().named_parameters(), overlap="yes")


def test_compiled_modules_wait_for_their_parameters():
    """compile=True compiles modules; their forward waits run eagerly and still order every read."""
    base, data = tiny_model(), batches(num=6)
    serial, overlapped = twin(base), twin(base)
    for model in (serial, overlapped):
        for layer in model:
            layer.compile()
    for overlap, model in ((False, serial), (True, overlapped)):
        opt = offload(model, overlap=overlap, offload_gradients=True)
        train_windows(model, opt, data, grad_accum=2, clip=0.5)
        opt.close()
    assert_same_params(serial, overlapped, rtol=0, atol=0)  # bit-identical


class _Layered(nn.Module):
    """Three transformer-like layers (each its own hand-off group) and an output projection."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 24)) for _ in range(3))
        self.out = nn.Linear(24, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_host_steps_of_a_hand_off_group_are_one_job_of_the_step_thread(clip, monkeypatch):
    """Without clipping each window queues one step job a group (three layers and the output's
    bucket: four) as it lands, not one a parameter (fourteen), and one landing job a group; with
    clipping (nothing steps before the last gradient has landed) one landing job and one step job
    (these groups hold less than LANDING_BYTES and STEP_JOB_BYTES). Either trains as plain AdamW
    does, bit for bit."""
    jobs, landings = [], []
    step, land = HostWorkers.step, HostWorkers.land
    monkeypatch.setattr(HostWorkers, "step", lambda self, fn, *args: jobs.append(args[0]) or step(self, fn, *args))
    monkeypatch.setattr(HostWorkers, "land", lambda self, fn, *args: landings.append(args[0]) or land(self, fn, *args))
    model, ref = _Layered(), _Layered()
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", overlap=True, offload_gradients=True,
                           minimal_size=0, lr=1e-2)
    opt.register_forward_waits(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = [(torch.randn(4, 24), torch.randn(4, 8)) for _ in range(6)]
    norms = train_windows(model, opt, data, grad_accum=2, clip=clip)
    assert train_windows(ref, ref_opt, data, grad_accum=2, clip=clip) == norms
    opt.synchronize()
    if clip is None:
        assert len(jobs) == 3 * 4 and all(len(slots) in (2, 4) for slots in jobs)
        assert sorted(map(len, landings)) == sorted(map(len, jobs))
    else:
        assert list(map(len, landings)) == list(map(len, jobs)) == [14] * 3
    assert_same_params(model, ref)
    opt.close()


def test_a_landing_job_measures_at_most_landing_bytes(monkeypatch):
    """A hand-off group's gradients land in jobs of at most LANDING_BYTES (an 8B layer's matrices
    one a job, on as many landing threads as there are cores); one larger than the bound alone."""
    landings = []
    land = HostWorkers.land
    monkeypatch.setattr(HostWorkers, "land", lambda self, fn, *args: landings.append(args[0]) or land(self, fn, *args))
    model, ref = _Layered(), _Layered()
    weight = model.layers[0][0].weight
    monkeypatch.setattr(overlap_scheduler, "LANDING_BYTES", weight.numel() * weight.element_size())
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", overlap=True, offload_gradients=True,
                           minimal_size=0, lr=1e-2)
    opt.register_forward_waits(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = [(torch.randn(4, 24), torch.randn(4, 8)) for _ in range(4)]
    assert train_windows(model, opt, data, grad_accum=2, clip=1.0) == train_windows(ref, ref_opt, data, grad_accum=2,
                                                                                    clip=1.0)
    opt.synchronize()
    sizes = [[slot.host_grad.nbytes for slot in job] for job in landings]
    assert len(landings) > 2 * 4 and all(sum(job) <= overlap_scheduler.LANDING_BYTES or len(job) == 1
                                                 for job in sizes), sizes
    assert_same_params(model, ref)
    opt.close()
