"""``OffloadOptimizer(update_on="device")``: states in host memory, the device's own update, on
the CPU emulation path, side by side with the same base optimizer without offload."""

import contextlib
import dataclasses

import pytest
import torch
from torch import nn

from tests.optim.side_by_side import batches, plain_hooks, through_a_file, tiny_model, train, twin
from tests.optim.test_overlap import train_windows
from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.optim.capabilities import PLAIN_CAPABILITIES, capabilities_of
from torchtune_offload.optim.host_arena import aligned_bytes
from torchtune_offload.optim.host_memory import plan_device_staging
from torchtune_offload.optim.optimizer_class import resolve_optimizer_class
from torchtune_offload.optim.stream_check import StreamOrderError, checked_streams

# Every weight (24*96 = 2304 elements and up) is streamed, every bias stays on the device.
MINIMAL_SIZE = 1000
# Two staging buffers of 8 KiB: fp32 AdamW states (8 bytes an element) of 512 elements at a time,
# so every streamed weight (2304, 15360 and 1280 elements) is stepped in several slices.
SMALL_BOUND_MIB = 16 / 1024


def device_opt(model: nn.Module, base="torch.optim.AdamW", **kwargs) -> OffloadOptimizer:
    kwargs.setdefault("device_staging_mib", SMALL_BOUND_MIB)
    return OffloadOptimizer(model.named_parameters(), base, update_on="device", minimal_size=MINIMAL_SIZE, **kwargs)


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("with_scheduler", [False, True])
def test_matches_plain_adamw_bit_for_bit(dtype, overlap, grad_accum, clip, with_scheduler):
    ref = tiny_model().to(dtype)
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    # The same number of slices for bf16 states as for fp32 ones.
    opt = device_opt(model, lr=1e-2, weight_decay=0.1, overlap=overlap,
                     device_staging_mib=SMALL_BOUND_MIB * dtype.itemsize / 4)
    if overlap:
        opt.register_forward_waits(model)
    assert {s.streamed for s in opt._slots} == {True, False}
    assert all(len(opt._streamer.slices(s)) > 1 for s in opt._slots if s.streamed)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=5 * grad_accum)]
    ref_scale, ref_clip = plain_hooks(ref)
    ref_norms = train(ref, ref_opt, data, grad_accum=grad_accum, clip=clip,
                      scheduler=cosine(ref_opt) if with_scheduler else None, scale_grads=ref_scale, clip_grads=ref_clip)
    norms = train(model, opt, data, grad_accum=grad_accum, clip=clip,
                  scheduler=cosine(opt) if with_scheduler else None, scale_grads=opt.scale_grads_,
                  clip_grads=opt.clip_grad_norm_)
    opt.synchronize()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert norms == ref_norms
    if clip is not None:
        assert max(ref_norms) > clip, "the clip threshold must bite for this test to mean anything"
    if with_scheduler:
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2
    # The states are the base optimizer's, in host buffers, equal to the plain run's.
    for slot, p in zip(opt._slots, ref.parameters()):
        for key, value in ref_opt.state[p].items():
            assert torch.equal(slot.optimizer.state[slot.param][key], value), (slot.key, key)


def test_overlap_orders_each_modules_forward_after_its_own_update_only():
    """The queued updates run on the update stream; each module's forward waits for its own
    parameters' updates right before it runs, and not yet for the later modules'."""
    model = tiny_model()
    opt = device_opt(model, lr=1e-2, overlap=True)
    opt.register_forward_waits(model)
    x, y = batches(num=1)[0]
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()
    pending = opt._streamer._pending
    slot_of = {i: opt._table.slot_of[m.weight].index for i, m in enumerate(model) if isinstance(m, nn.Linear)}
    assert set(pending) == {s.index for s in opt._slots if s.streamed} == set(slot_of.values())
    seen = []
    hooks = [m.register_forward_pre_hook(lambda m, _args, i=i: seen.append((i, sorted(pending))))
             for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    model(x)
    for h in hooks:
        h.remove()
    # Each linear's hook (registered after the waits) runs once its own weight's wait is made.
    order = sorted(slot_of)
    assert [i for i, _ in seen] == order
    for n, (i, still) in enumerate(seen):
        assert still == sorted(slot_of[j] for j in order[n + 1:]), (i, still)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlap", [False, True])
def test_resume_is_bit_identical_and_loads_into_host_buffers(overlap, dtype):
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(num=12)]
    kwargs = dict(lr=1e-2, overlap=overlap)

    def run(model, opt, sched, chunk):
        train(model, opt, chunk, grad_accum=2, clip=0.5, scheduler=sched, scale_grads=opt.scale_grads_,
              clip_grads=opt.clip_grad_norm_)

    def model_of(seed=0):  # in the run's dtype (bf16: the states the host holds are bf16 too)
        return tiny_model(seed=seed).to(dtype)

    straight = model_of()
    opt = device_opt(straight, **kwargs)
    opt.register_forward_waits(straight)
    run(straight, opt, cosine(opt), data)
    opt.synchronize()  # the last step's updates wait for a forward that does not come

    first = model_of()
    opt = device_opt(first, **kwargs)
    opt.register_forward_waits(first)
    sched = cosine(opt)
    run(first, opt, sched, data[:6])
    ckpt = through_a_file({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})

    resumed = model_of(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt = device_opt(resumed, **{**kwargs, "lr": 5.0})
    opt.register_forward_waits(resumed)
    host_before = {s.key: {k: t.data_ptr() for k, t in opt._streamer._host[s.index].items()} for s in opt._slots
                   if s.streamed}
    sched = cosine(opt)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    for slot in opt._slots:
        if slot.streamed:
            state = slot.optimizer.state[slot.param]
            assert {k: state[k].data_ptr() for k in host_before[slot.key]} == host_before[slot.key]
    run(resumed, opt, sched, data[6:])
    opt.synchronize()
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_from_the_host_engine_is_refused_by_name():
    model = tiny_model()
    host = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE)
    with pytest.raises(ValueError, match="update_on: checkpoint host, now device"):
        device_opt(tiny_model()).load_state_dict(host.state_dict())


class SlicedAdamW(torch.optim.AdamW):
    """AdamW that declares itself elementwise and records the bytes of every state it is given."""

    capabilities = dataclasses.replace(PLAIN_CAPABILITIES, elementwise_update=True)
    staged: list = []

    def step(self, closure=None):
        for p in self.param_groups[0]["params"]:
            SlicedAdamW.staged.append(sum(t.numel() * t.element_size() for t in self.state[p].values()
                                          if isinstance(t, torch.Tensor) and t.dim() > 0))
        return super().step(closure)


def test_device_staging_never_exceeds_the_bound():
    model = tiny_model()
    bound = SMALL_BOUND_MIB * 2**20
    largest = max(p.numel() * 8 for p in model.parameters())  # fp32 AdamW: 8 bytes of state an element
    assert bound < largest, "the bound must be smaller than the largest tensor's states"
    SlicedAdamW.staged = []
    opt = device_opt(model, SlicedAdamW, lr=1e-2)
    scale, clip = opt.scale_grads_, opt.clip_grad_norm_
    train(model, opt, batches(num=3), grad_accum=1, clip=None, scale_grads=scale, clip_grads=clip)
    report = opt.memory_report()
    assert 0 < report.device_staging_bytes <= bound
    staged = [b for b in SlicedAdamW.staged if b]  # the first step's slices start with no state
    assert staged and max(staged) <= bound / 2
    # Each staged state lies in one of the staging buffers.
    buffers = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in opt._streamer._buffers]
    assert sum(hi - lo for lo, hi in buffers) == report.device_staging_bytes


def test_too_small_a_bound_for_whole_staged_states_is_refused_before_allocating():
    model = tiny_model().bfloat16()
    with pytest.raises(ValueError, match=r"optimizer\.device_staging_mib.*staged whole.*at least"):
        device_opt(model, AdamW8bit, lr=1e-3, min_8bit_size=1000)


@pytest.mark.parametrize("base, options, bound_mib", [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True), SMALL_BOUND_MIB / 2),  # one state, 4 bytes
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1), SMALL_BOUND_MIB),
    (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True), SMALL_BOUND_MIB),
    # Adagrad makes its state in its constructor: adopted into the host buffers at once.
    (torch.optim.Adagrad, dict(lr=1e-2, initial_accumulator_value=0.1), SMALL_BOUND_MIB / 2),
    # Blockwise 8-bit states (absmax per 256 elements) are staged whole; bitsandbytes' state_dict
    # packs them (its own loader unpacks them on resume).
    (AdamW8bit, dict(lr=1e-3, min_8bit_size=1000), 1.0),
    ("bitsandbytes.optim.AdamW8bit", dict(lr=1e-3, min_8bit_size=1000), 1.0),
])
@pytest.mark.parametrize("overlap", [False, True])
def test_other_base_optimizers_match_themselves_without_offload_and_resume(base, options, bound_mib, overlap):
    cls = resolve_optimizer_class(base)
    ref = tiny_model().bfloat16() if cls is AdamW8bit else tiny_model()
    model = twin(ref)
    ref_opt = cls(ref.parameters(), **options)
    opt = device_opt(model, base, device_staging_mib=bound_mib, overlap=overlap, **options)
    if overlap:  # updates wait for the forward that reads them
        opt.register_forward_waits(model)
    whole = not capabilities_of(cls).elementwise_update
    assert all((len(opt._streamer.slices(s)) == 1) == whole for s in opt._slots if s.streamed)
    data = [(x.to(ref[0].weight.dtype), y.to(ref[0].weight.dtype)) for x, y in batches(num=8)]
    scale, clip = plain_hooks(ref)
    train(ref, ref_opt, data, grad_accum=2, clip=0.5, scale_grads=scale, clip_grads=clip)
    train(model, opt, data[:4], grad_accum=2, clip=0.5, scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_)
    saved = through_a_file({"model": model.state_dict(), "opt": opt.state_dict()})
    resumed = tiny_model(seed=123).to(ref[0].weight.dtype)  # not a copy of model: that holds its hooks
    resumed.load_state_dict(saved["model"])
    opt = device_opt(resumed, base, device_staging_mib=bound_mib, overlap=overlap, **options)
    if overlap:
        opt.register_forward_waits(resumed)
    opt.load_state_dict(saved["opt"])
    train(resumed, opt, data[4:], grad_accum=2, clip=0.5, scale_grads=opt.scale_grads_,
          clip_grads=opt.clip_grad_norm_)
    opt.synchronize()  # the last step's updates wait for a forward that does not come
    for a, b in zip(ref.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_host_memory_is_the_states_exactly():
    model = tiny_model().bfloat16()
    opt = device_opt(model, lr=1e-2)
    planned = OffloadOptimizer.plan_host_memory(model.named_parameters(), "torch.optim.AdamW", device="cpu",
                                                update_on="device", minimal_size=MINIMAL_SIZE)
    streamed = [p for p in model.parameters() if p.numel() >= MINIMAL_SIZE]
    # Two bf16 states an element, each buffer on a page boundary; nothing else on the host.
    expected = sum(2 * aligned_bytes(p.numel() * 2) for p in streamed)
    assert opt.memory_report().host_bytes == planned.total == expected
    x, y = batches(num=1)[0]
    ((model(x.bfloat16()) - y.bfloat16()) ** 2).sum().backward()
    opt.step()
    report = opt.memory_report()
    assert report.host_bytes == expected
    assert report.device_bytes_saved == sum(4 * p.numel() for p in streamed)
    assert report.num_offloaded == len(streamed)
    # The planner's figure for the staging buffers is what was allocated.
    assert plan_device_staging(list(model.named_parameters()), base_class=torch.optim.AdamW, options={"lr": 1e-2},
                               minimal_size=MINIMAL_SIZE,
                               staging_bytes=int(SMALL_BOUND_MIB * 2**20)) == report.device_staging_bytes
    assert set(opt.step_timings()) >= {"state_upload_s", "state_download_s", "offload_step_s"}


@pytest.mark.parametrize("options, keys", [
    (dict(offload_gradients=True), r"optimizer\.update_on=device with optimizer\.offload_gradients=True.*"
                                   r"optimizer\.offload_gradients=False"),
    (dict(master_dtype="fp32"), r"optimizer\.update_on=device with optimizer\.master_dtype=fp32"),
    (dict(grad_sum_dtype="fp32"), r"optimizer\.update_on=device with optimizer\.grad_sum_dtype=fp32"),
    (dict(device_staging_mib=0), r"optimizer\.device_staging_mib=0 must be a positive number"),
    (dict(device_staging_mib="big"), r"optimizer\.device_staging_mib='big'"),
])
def test_combinations_that_cannot_work_are_refused_naming_both_keys(options, keys):
    with pytest.raises(ValueError, match=keys):
        device_opt(tiny_model(), **options)


def test_bad_update_on_is_named():
    with pytest.raises(ValueError, match=r"optimizer\.update_on='gpu': use 'host'.*or 'device'"):
        OffloadOptimizer(tiny_model().named_parameters(), update_on="gpu")


def test_a_groups_own_options_plan_its_own_states():
    """Two weights of one shape in two groups, amsgrad (a third state) in the second only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 48))
    ref = twin(model)
    ref_opt = torch.optim.Adam([{"params": list(ref[0].parameters())},
                                {"params": list(ref[2].parameters()), "amsgrad": True}], lr=1e-2)
    named = list(model.named_parameters())
    opt = OffloadOptimizer([{"params": named[:2]}, {"params": named[2:], "amsgrad": True}], "torch.optim.Adam", lr=1e-2,
                           update_on="device", minimal_size=MINIMAL_SIZE, device_staging_mib=SMALL_BOUND_MIB)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x = torch.randn(6, 48, generator=g)
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert "max_exp_avg_sq" in opt._slots[2].optimizer.state[opt._slots[2].param]


def test_a_parameter_no_module_owns_is_updated_in_step():
    """With overlap, only updates a registered module's forward waits for are queued."""
    model = tiny_model()
    extra = nn.Parameter(torch.ones(2048))
    opt = OffloadOptimizer([*model.named_parameters(), ("extra", extra)], "torch.optim.AdamW", lr=1e-2, overlap=True,
                           update_on="device", minimal_size=MINIMAL_SIZE, device_staging_mib=SMALL_BOUND_MIB)
    opt.register_forward_waits(model)
    x, y = batches(num=1)[0]
    (((model(x) - y) ** 2).sum() + extra.sum()).backward()
    opt.step()
    assert not torch.equal(extra, torch.ones(2048))  # updated in step()
    pending = opt._streamer._pending
    # On the compute stream, not queued; the module's weight is queued for the next forward.
    assert opt._table.slot_of[extra].index not in pending and opt._table.slot_of[model[0].weight].index in pending


class FailingAdamW(torch.optim.AdamW):
    """AdamW whose third slice step on a real tensor raises, once (its meta probe steps as usual)."""

    capabilities = dataclasses.replace(PLAIN_CAPABILITIES, elementwise_update=True)
    calls = 0

    def step(self, closure=None):
        if not self.param_groups[0]["params"][0].is_meta:
            FailingAdamW.calls += 1
            if FailingAdamW.calls == 3:
                raise RuntimeError("boom")
        return super().step(closure)


def test_a_failed_update_leaves_the_optimizer_on_its_host_states():
    model = tiny_model()
    FailingAdamW.calls = 0
    # Every parameter streamed, so that the third step is the first weight's third slice.
    opt = OffloadOptimizer(model.named_parameters(), FailingAdamW, lr=1e-2, update_on="device", minimal_size=1,
                           device_staging_mib=SMALL_BOUND_MIB)
    x, y = batches(num=1)[0]
    with pytest.raises(RuntimeError, match="boom"):
        ((model(x) - y) ** 2).sum().backward()
        opt.step()
    slot = next(s for s in opt._slots if s.streamed)
    assert FailingAdamW.calls == 3 and len(opt._streamer.slices(slot)) > 3  # it failed inside the first slot
    (stepped,) = slot.optimizer.param_groups[0]["params"]
    assert stepped is slot.param
    assert all(key is slot.param for key in slot.optimizer.state)


def test_a_bitsandbytes_checkpoint_with_other_states_is_refused_before_anything_loads():
    model = tiny_model()
    opt = device_opt(model, "bitsandbytes.optim.AdamW8bit", lr=1e-3, min_8bit_size=1000, device_staging_mib=1.0)
    x, y = batches(num=1)[0]
    ((model(x) - y) ** 2).sum().backward()
    opt.step()
    saved = opt.state_dict()
    # The same shapes, but 32-bit states for the smaller weights (below min_8bit_size 3000).
    other = device_opt(twin(model), "bitsandbytes.optim.AdamW8bit", lr=1e-3, min_8bit_size=3000,
                       device_staging_mib=1.0)
    with pytest.raises(ValueError, match=r"0\.weight: state 'state1' is torch\.uint8\[96, 24\] in the checkpoint, "
                                         r"torch\.float32\[96, 24\] here"):
        other.load_state_dict(saved)
    assert all(not s.optimizer.state for s in other._slots), "a slot was loaded before the refusal"


@pytest.mark.parametrize("options, message", [
    (dict(update_on="host", device_staging_mib=64),
     r"optimizer\.device_staging_mib=64 with optimizer\.update_on=host"),
    (dict(update_on="device", overlap_timeout_s=30),
     r"optimizer\.update_on=device with optimizer\.overlap_timeout_s=30"),
])
def test_options_of_the_other_mode_are_refused_not_ignored(options, message):
    with pytest.raises(ValueError, match=message):
        OffloadOptimizer(tiny_model().named_parameters(), **options)


def _bitsandbytes_kernels_on_the_default_stream(monkeypatch, device) -> None:
    """bitsandbytes' update kernels as they run on a GPU: on the device's default stream, whatever
    torch's current stream is (the reason its updates are never moved to a side stream)."""
    functional = pytest.importorskip("bitsandbytes.functional")
    for name in ("optimizer_update_32bit", "optimizer_update_8bit_blockwise"):
        original = getattr(functional, name)

        def on_default_stream(*args, _original=original, **kwargs):
            with device.stream(device.default_stream()):
                return _original(*args, **kwargs)

        monkeypatch.setattr(functional, name, on_default_stream)


@pytest.mark.streams_as_is
@pytest.mark.parametrize("side_stream_safe", [False, True], ids=["as built", "guard undone"])
def test_bitsandbytes_updates_stay_off_the_side_stream(monkeypatch, side_stream_safe):
    """With overlap, torch's optimizers update on a side stream in the next forward's order; a
    bitsandbytes kernel would ignore that stream and race the staging copies, so its updates run
    on the compute stream (capabilities: kernels_on_current_stream=False). Undoing the guard must be
    caught on virtual streams, with the kernels placed as bitsandbytes places them."""
    bnb = pytest.importorskip("bitsandbytes")
    assert capabilities_of(bnb.optim.AdamW8bit).kernels_on_current_stream is False
    model = tiny_model()
    with contextlib.ExitStack() as stack:
        device = stack.enter_context(checked_streams())
        _bitsandbytes_kernels_on_the_default_stream(monkeypatch, device)
        opt = device_opt(model, "bitsandbytes.optim.AdamW8bit", overlap=True, device_staging_mib=1.0, lr=1e-3,
                         min_8bit_size=1000)
        opt.register_forward_waits(model)
        opt._streamer._side_stream_safe = side_stream_safe
        if side_stream_safe:
            stack.enter_context(pytest.raises(StreamOrderError))
        train_windows(model, opt, batches(num=4), grad_accum=2, clip=0.5)
        opt.synchronize()
        opt.close()
