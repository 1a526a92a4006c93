"""OffloadOptimizer against plain optimizers, trained side by side on the CPU emulation path."""

import copy

import pytest
import torch
from torch import nn

from tests.optim.side_by_side import assert_same_params, batches, plain_hooks, through_a_file, tiny_model, train, twin
from tests.torchao_on_cpu import torchao_on_cpu
from torchtune.config._utils import _get_component_from_path
from torchtune.training.lr_schedulers import get_cosine_schedule_with_warmup, get_lr

from torchtune_offload import CPUOffloadOptimizer, OffloadOptimizer
from torchtune_offload.optim.grad_norm import total_norm
from torchtune_offload.optim.host_arena import aligned_bytes

# Smaller than every weight (24*96 = 2304 elements) but larger than every bias: both paths run.
MINIMAL_SIZE = 1000


def offload_hooks(opt: OffloadOptimizer):
    return opt.scale_grads_, opt.clip_grad_norm_


def cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5, eta_min=1e-4)


@pytest.mark.parametrize("offload_gradients", [False, True])
@pytest.mark.parametrize("grad_accum", [1, 3])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("with_scheduler", [False, True])
def test_matches_plain_adamw(offload_gradients, grad_accum, clip, with_scheduler):
    ref = tiny_model()
    model = twin(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = OffloadOptimizer(
        model.named_parameters(),
        "torch.optim.AdamW",
        offload_gradients=offload_gradients,
        minimal_size=MINIMAL_SIZE,
        lr=1e-2,
        weight_decay=0.1,
    )
    assert {s.offloaded for s in opt._slots} == {True, False}
    data = batches(num=5 * grad_accum)

    def offloaded_grads_are_gone():
        if offload_gradients:
            assert all(s.param.grad is None for s in opt._slots if s.offloaded)
            assert all(s.param.grad is not None for s in opt._slots if not s.offloaded)

    ref_scale, ref_clip = plain_hooks(ref)
    ref_norms = train(
        ref, ref_opt, data, grad_accum=grad_accum, clip=clip,
        scheduler=cosine(ref_opt) if with_scheduler else None,
        scale_grads=ref_scale, clip_grads=ref_clip,
    )
    norms = train(
        model, opt, data, grad_accum=grad_accum, clip=clip,
        scheduler=cosine(opt) if with_scheduler else None,
        scale_grads=opt.scale_grads_, clip_grads=opt.clip_grad_norm_,
        after_backward=offloaded_grads_are_gone,
    )
    assert_same_params(ref, model)
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    if clip is not None:
        assert max(ref_norms) > clip, "the clip threshold must bite for this test to mean anything"
    if with_scheduler:
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] != 1e-2


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_grad_norm_reports_what_will_be_stepped(offload_gradients):
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), offload_gradients=offload_gradients, minimal_size=MINIMAL_SIZE)
    ref = twin(model)
    for x, y in batches(num=2):
        ((model(x) - y) ** 2).sum().backward()
        ((ref(x) - y) ** 2).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(opt.grad_norm(), expected)
    opt.scale_grads_(0.5)
    torch.testing.assert_close(opt.grad_norm(), expected * 0.5)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_resume_is_bit_identical(offload_gradients):
    data = batches(num=12)
    kwargs = dict(offload_gradients=offload_gradients, minimal_size=MINIMAL_SIZE, lr=1e-2)

    def run(model, opt, sched, chunk):
        scale, clip = offload_hooks(opt)
        train(model, opt, chunk, grad_accum=2, clip=0.5, scheduler=sched, scale_grads=scale, clip_grads=clip)

    straight = tiny_model()
    opt = OffloadOptimizer(straight.named_parameters(), **kwargs)
    sched = cosine(opt)
    run(straight, opt, sched, data)

    first = tiny_model()
    opt = OffloadOptimizer(first.named_parameters(), **kwargs)
    sched = cosine(opt)
    run(first, opt, sched, data[:6])
    ckpt = through_a_file({"model": first.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()})

    resumed = tiny_model(seed=123)
    resumed.load_state_dict(ckpt["model"])
    opt = OffloadOptimizer(resumed.named_parameters(), **{**kwargs, "lr": 5.0})
    sched = cosine(opt)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    run(resumed, opt, sched, data[6:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_frozen_parameters_are_skipped_and_untouched():
    ref = tiny_model(frozen_first=True)
    model = twin(ref)
    frozen_before = model[0].weight.detach().clone()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE, lr=1e-2)
    assert {s.key for s in opt._slots} == {"2.weight", "2.bias", "4.weight", "4.bias"}
    data = batches(num=4)
    train(ref, ref_opt, data, grad_accum=1, clip=None, scale_grads=plain_hooks(ref)[0], clip_grads=None)
    train(model, opt, data, grad_accum=1, clip=None, scale_grads=opt.scale_grads_, clip_grads=None)
    assert torch.equal(model[0].weight, frozen_before)
    assert_same_params(ref, model)


@pytest.mark.parametrize(
    "spec, kwargs",
    [
        ("torch.optim.AdamW", dict(lr=1e-2)),
        ("torch.optim.SGD", dict(lr=1e-2, momentum=0.9)),
        ("bitsandbytes.optim.AdamW8bit", dict(lr=1e-2)),
    ],
)
def test_optimizer_class_as_string(spec, kwargs):
    cls = _get_component_from_path(spec)
    ref = tiny_model()
    model = twin(ref)
    ref_opt = cls(ref.parameters(), **kwargs)
    opt = OffloadOptimizer(model.named_parameters(), spec, minimal_size=MINIMAL_SIZE, **kwargs)
    assert all(isinstance(s.optimizer, cls) for s in opt._slots)
    data = batches(num=4)
    train(ref, ref_opt, data, grad_accum=2, clip=None, scale_grads=plain_hooks(ref)[0], clip_grads=None)
    train(model, opt, data, grad_accum=2, clip=None, scale_grads=opt.scale_grads_, clip_grads=None)
    assert_same_params(ref, model)
    assert not torch.equal(model[0].weight, tiny_model()[0].weight), "the model must have moved"


def test_param_groups_keep_their_own_hyperparameters():
    ref = tiny_model()
    model = twin(ref)

    def groups(m, named):
        decay = [(n, p) for n, p in m.named_parameters() if n.endswith("weight")]
        no_decay = [(n, p) for n, p in m.named_parameters() if n.endswith("bias")]
        strip = (lambda ps: ps) if named else (lambda ps: [p for _, p in ps])
        return [{"params": strip(decay)}, {"params": strip(no_decay), "weight_decay": 0.0, "lr": 3e-2}]

    ref_opt = torch.optim.AdamW(groups(ref, False), lr=1e-2, weight_decay=0.5)
    opt = OffloadOptimizer(groups(model, True), minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.5)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]
    data = batches(num=4)
    train(ref, ref_opt, data, grad_accum=1, clip=None, scheduler=cosine(ref_opt), scale_grads=plain_hooks(ref)[0], clip_grads=None)
    train(model, opt, data, grad_accum=1, clip=None, scheduler=cosine(opt), scale_grads=opt.scale_grads_, clip_grads=None)
    assert_same_params(ref, model)


def test_torchtune_get_lr_reads_it():
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE, lr=1e-2)
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=10)
    sched.step()
    assert get_lr(opt) == pytest.approx(0.5e-2)


def test_memory_report_counts_offloaded_state():
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=MINIMAL_SIZE, offload_gradients=True, lr=1e-2)
    before = opt.memory_report()
    assert before.device_bytes_saved == sum(
        p.numel() * 4 for p in model.parameters() if p.numel() >= MINIMAL_SIZE
    ), "before the first step only the gradient buffers are offloaded"
    for x, y in batches(num=1):
        ((model(x) - y) ** 2).sum().backward()
    opt.step()
    report = opt.memory_report()
    big = [p for p in model.parameters() if p.numel() >= MINIMAL_SIZE]
    # AdamW keeps exp_avg and exp_avg_sq (4 bytes each per element) plus a 0-dim fp32 step.
    state = sum(2 * p.numel() * 4 + 4 for p in big)
    grads = sum(p.numel() * 4 for p in big)
    buffers = sum(aligned_bytes(p.numel() * 4) for p in big)  # each at a page of one host block
    assert report.num_offloaded == len(big) == 3
    assert report.num_on_device == 3
    assert report.device_bytes_saved == state + grads
    assert report.host_bytes == state + buffers + buffers  # gradient buffers + the host parameter copies
    assert report.pinned_bytes == 0  # nothing is pinned without an accelerator


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    "spec, match",
    [
        ("torch.optim.AdamWW", "does not resolve"),
        ("not_a_module_xyz.Opt", "does not resolve"),
        ("torch.nn.Linear", "not a torch.optim.Optimizer"),
        ("", "is empty"),
        (42, "not a torch.optim.Optimizer"),
        ("torchtune_offload.OffloadOptimizer", "do not nest"),
        ("torchtune_offload.CPUOffloadOptimizer", "do not nest"),
    ],
)
def test_bad_optimizer_class(spec, match):
    with pytest.raises(ValueError, match=match) as info:
        OffloadOptimizer(tiny_model().named_parameters(), spec)
    assert "optimizer.optimizer_class" in str(info.value)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(minimal_size=-1), "optimizer.minimal_size"),
        (dict(minimal_size=1.5), "optimizer.minimal_size"),
        (dict(offload_gradients="yes"), "optimizer.offload_gradients"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffloadOptimizer(tiny_model().named_parameters(), **kwargs)


def test_bad_params():
    model = tiny_model()
    with pytest.raises(ValueError, match="empty parameter list"):
        OffloadOptimizer([])
    with pytest.raises(ValueError, match="nothing to optimize"):
        OffloadOptimizer(model.requires_grad_(False).named_parameters())
    with pytest.raises(ValueError, match="single tensor"):
        OffloadOptimizer(nn.Parameter(torch.ones(3)))
    with pytest.raises(ValueError, match="given twice"):
        p = nn.Parameter(torch.ones(3))
        OffloadOptimizer([("a", p), ("a", p)])


def test_base_optimizer_errors_surface():
    with pytest.raises(ValueError, match="Invalid learning rate"):
        OffloadOptimizer(tiny_model().named_parameters(), lr=-1.0)


def _trained_state(**kwargs):
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), lr=1e-2, **kwargs)
    for x, y in batches(num=1):
        ((model(x) - y) ** 2).sum().backward()
    opt.step()
    return opt.state_dict()


@pytest.mark.parametrize(
    "make_target, match",
    [
        (lambda: OffloadOptimizer(tiny_model().named_parameters(), minimal_size=10_000), "minimal_size=1000"),
        (lambda: OffloadOptimizer(tiny_model().named_parameters(), "torch.optim.SGD", lr=1.0, minimal_size=MINIMAL_SIZE), "optimizer_class"),
        (lambda: OffloadOptimizer(tiny_model(frozen_first=True).named_parameters(), minimal_size=MINIMAL_SIZE), "not trainable here"),
        (lambda: OffloadOptimizer(nn.Sequential(nn.Linear(24, 97)).named_parameters(), minimal_size=MINIMAL_SIZE), "0.weight"),
        (lambda: OffloadOptimizer(tiny_model().parameters(), minimal_size=MINIMAL_SIZE), "missing from the checkpoint"),
    ],
)
def test_checkpoint_that_does_not_fit_is_refused(make_target, match):
    state = _trained_state(minimal_size=MINIMAL_SIZE)
    target = make_target()
    before = {s.key: s.optimizer.state_dict() for s in target._slots}
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(state)
    assert {s.key: s.optimizer.state_dict() for s in target._slots} == before, "nothing loads on error"


def _without(state, path):
    """A deep copy of ``state`` without the entry at ``path`` (keys; ``"*"`` is the first parameter)."""
    state = copy.deepcopy(state)
    entry = state
    for key in path[:-1]:
        entry = entry[next(iter(entry))] if key == "*" else entry[key]
    del entry[path[-1]]
    return state


@pytest.mark.parametrize("path, match", [
    (("minimal_size",), "entries missing \\(minimal_size\\)"),
    (("state", "*", "shape"), "entries missing \\(state\\['.*'\\]\\['shape'\\]\\)"),
    (("state", "*", "optimizer"), "\\['optimizer'\\]"),
    (("param_groups", 0, "params"), "param_groups\\[0\\]\\['params'\\]"),
])
def test_damaged_checkpoint_is_refused_by_entry(path, match):
    """A checkpoint of this format with an entry missing (edited, or cut short by hand) is named,
    not a ``KeyError`` halfway through checking it, and nothing loads."""
    state = _trained_state(minimal_size=MINIMAL_SIZE)
    target = OffloadOptimizer(tiny_model().named_parameters(), minimal_size=MINIMAL_SIZE)
    before = {s.key: s.optimizer.state_dict() for s in target._slots}
    with pytest.raises(ValueError, match=match):
        target.load_state_dict(_without(state, path))
    assert {s.key: s.optimizer.state_dict() for s in target._slots} == before


def test_checkpoint_entries_of_the_wrong_kind_are_refused_by_name():
    state = _trained_state(minimal_size=MINIMAL_SIZE)
    key = next(iter(state["state"]))
    state["state"][key]["shape"] = None
    target = OffloadOptimizer(tiny_model().named_parameters(), minimal_size=MINIMAL_SIZE)
    with pytest.raises(ValueError, match=r"\['shape'\] \(a list\)"):
        target.load_state_dict(state)


@pytest.mark.parametrize("optimizer_class, options", [
    ("torch.optim.AdamW", {}), ("torch.optim.SGD", {"momentum": 0.9}),
    ("torchtune_offload.optim.AdamW8bit", {"min_8bit_size": 1}),
])
def test_checkpoint_with_a_base_state_of_another_shape_is_refused_before_loading(optimizer_class, options):
    """torch's optimizers (and AdamW8bit) load a state of the wrong shape and fail only at the first
    step, naming no parameter: the state is named at load, and nothing loads."""
    state = _trained_state_of(optimizer_class, options)
    key = next(k for k, v in state["state"].items() if v["offloaded"])
    inner = next(iter(state["state"][key]["optimizer"]["state"].values()))
    name = next(k for k, v in inner.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
    inner[name] = inner[name][:1]
    target = OffloadOptimizer(tiny_model().named_parameters(), optimizer_class, lr=1e-2, minimal_size=MINIMAL_SIZE,
                              **options)
    before = {s.key: s.optimizer.state_dict() for s in target._slots}
    with pytest.raises(ValueError, match=f"{key}: optimizer state '{name}' is \\[1"):
        target.load_state_dict(state)
    assert {s.key: s.optimizer.state_dict() for s in target._slots} == before
    target.load_state_dict(_trained_state_of(optimizer_class, options))  # an intact one still loads


def _trained_state_of(optimizer_class, options):
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, lr=1e-2, minimal_size=MINIMAL_SIZE, **options)
    for x, y in batches(num=1):
        ((model(x) - y) ** 2).sum().backward()
    opt.step()
    return opt.state_dict()


def test_checkpoint_with_master_weights_of_another_shape_is_refused_before_loading():
    """fp32 masters are copied after the base states load: a wrong one is found first, so the
    base states are not left loaded beside a failed copy."""
    model = tiny_model().to(torch.bfloat16)
    opt = OffloadOptimizer(model.named_parameters(), lr=1e-2, minimal_size=MINIMAL_SIZE, master_dtype="fp32")
    for x, y in batches(num=1):
        ((model(x.bfloat16()) - y) ** 2).sum().backward()
    opt.step()
    state = opt.state_dict()
    key = next(k for k, v in state["state"].items() if "master" in v)
    state["state"][key]["master"] = state["state"][key]["master"][:1]
    target = OffloadOptimizer(tiny_model().to(torch.bfloat16).named_parameters(), minimal_size=MINIMAL_SIZE,
                              master_dtype="fp32")
    before = {s.key: s.optimizer.state_dict() for s in target._slots}
    with pytest.raises(ValueError, match=f"{key}: master weights in the checkpoint are torch.float32"):
        target.load_state_dict(state)
    assert {s.key: s.optimizer.state_dict() for s in target._slots} == before


def test_checkpoint_from_another_optimizer_is_refused():
    model = tiny_model()
    plain = torch.optim.AdamW(model.parameters())
    opt = OffloadOptimizer(model.named_parameters())
    with pytest.raises(ValueError, match="not an OffloadOptimizer checkpoint"):
        opt.load_state_dict(plain.state_dict())


def test_reordered_named_parameters_load_by_name():
    state = _trained_state(minimal_size=MINIMAL_SIZE)
    model = tiny_model()
    opt = OffloadOptimizer(list(reversed(list(model.named_parameters()))), minimal_size=MINIMAL_SIZE)
    # Same names, another order: the groups check reports it rather than loading by position.
    with pytest.raises(ValueError, match="ordered differently"):
        opt.load_state_dict(state)


def test_cpu_offload_optimizer_without_accelerator_names_the_alternative():
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(ValueError, match="torchtune_offload.OffloadOptimizer"):
        CPUOffloadOptimizer(tiny_model().named_parameters(), "torch.optim.AdamW")
    with pytest.raises(ValueError, match="does not resolve"):
        CPUOffloadOptimizer(tiny_model().named_parameters(), "torch.optim.Nope")


def test_cpu_offload_optimizer_resumed_keeps_its_schedule_on_the_device_step(monkeypatch):
    """After load_state_dict the groups an LR scheduler reads and sets are the ones the on-device
    step uses, with the saved initial_lr (torchao's step on the CPU: tests/torchao_on_cpu.py)."""
    torchao_on_cpu(monkeypatch)

    def build():
        return CPUOffloadOptimizer(tiny_model().named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE,
                                   lr=1e-2)

    opt = build()
    assert opt.d_opt is not None and opt.param_d2h_map  # both step paths
    cosine(opt)
    resumed = build()
    resumed.load_state_dict(through_a_file(opt.state_dict()))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(resumed, T_max=5, eta_min=1e-4, last_epoch=0)
    scheduler.step()
    lrs = {g["lr"] for g in resumed.param_groups} | {g["lr"] for g in resumed.d_opt.param_groups}
    assert lrs == {scheduler.get_last_lr()[0]} and lrs != {1e-2}


@pytest.mark.parametrize("offload_gradients, grad_accum", [(False, 2), (True, 1)])
def test_cpu_offload_optimizer_measures_the_logged_norm_on_the_device(monkeypatch, offload_gradients, grad_accum):
    """The norm the recipe logs every step is the norm of the gradients torchao steps on, as the
    host copies give it, but measured on the device during backward: no pass over the host copies
    (which reading them here would be)."""
    torchao_on_cpu(monkeypatch)
    model = tiny_model()
    opt = CPUOffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=MINIMAL_SIZE, lr=1e-2,
                              offload_gradients=offload_gradients)
    assert opt.d_opt is not None and opt.param_d2h_map  # both step paths
    for window in range(2):
        for x, y in batches(num=grad_accum, seed=window):
            ((model(x) - y) ** 2).sum().backward()
        host = total_norm(opt._grads_to_step(), device="cpu")
        with monkeypatch.context() as patch:
            patch.setattr(type(opt), "_grads_to_step", lambda self: pytest.fail("read the host copies"))
            assert torch.equal(opt.grad_norm(), host)
        opt.step()
        opt.zero_grad()


def test_close_removes_hooks():
    model = tiny_model()
    opt = OffloadOptimizer(model.named_parameters(), offload_gradients=True, minimal_size=MINIMAL_SIZE)
    opt.close()
    x, y = batches(num=1)[0]
    ((model(x) - y) ** 2).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
