"""The engine refuses bad input by name before it allocates or changes anything: a parameter given
twice, a param group's option, clipping arguments that would not clip, a non-finite scale, and a
checkpoint that one base optimizer refuses after others accepted theirs."""

import math

import pytest
import torch
from torch import nn

from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import param_table


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16))


def _train(model: nn.Module, opt, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(2, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("minimal_size", [0, 10**9])  # offloaded, or stepped on the device
def test_a_tensor_given_twice_is_refused_before_any_host_buffer(monkeypatch, minimal_size):
    # Before: a parameter kept on the device and given twice was stepped twice, with only torch's
    # warning; an offloaded one was refused, but after the other host buffers were planned.
    model = _model()
    monkeypatch.setattr(param_table, "host_buffers", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(ValueError, match=r"one tensor is given as '1.weight' and as 'again'; give each parameter once"):
        OffloadOptimizer([*model.named_parameters(), ("again", model[1].weight)], minimal_size=minimal_size)
    groups = [{"params": [("a", model[0].weight)]}, {"params": [("b", model[0].weight)], "lr": 0.1}]
    with pytest.raises(ValueError, match="one tensor is given as 'a' and as 'b'"):
        OffloadOptimizer(groups, minimal_size=minimal_size)
    with pytest.raises(ValueError, match="parameter '0.bias' is given twice"):
        OffloadOptimizer([*model.named_parameters(), ("0.bias", torch.nn.Parameter(torch.zeros(16)))],
                         minimal_size=minimal_size)


def test_a_param_groups_options_are_checked_before_any_host_buffer(monkeypatch):
    model = _model()
    monkeypatch.setattr(param_table, "host_buffers", lambda *a, **k: pytest.fail("allocated before refusing"))
    with pytest.raises(ValueError, match=r"optimizer.lr=-1.0: OffloadOptimizer param group 1 \(base AdamW\) refuses"):
        OffloadOptimizer([{"params": [("w", model[0].weight)]}, {"params": [("b", model[0].bias)], "lr": -1.0}],
                         minimal_size=0)
    with pytest.raises(ValueError, match="optimizer.lrr=0.1"):
        OffloadOptimizer([{"params": list(model.named_parameters()), "lrr": 0.1}], minimal_size=0)


@pytest.mark.parametrize("max_norm", [-1.0, 0.0, math.nan, "1.0", True])
def test_clipping_refuses_a_max_norm_that_would_not_clip(max_norm):
    # Before: -1.0 flipped every gradient's sign (as torch's clip_grad_norm_ does), nan made every weight nan.
    model = _model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True)
    model(torch.randn(2, 16)).sum().backward()
    grads = [g.clone() for _, g in opt._grads.to_step()]
    with pytest.raises(ValueError, match=r"max_norm=.*: give a positive number \(inf measures the norm"):
        opt.clip_grad_norm_(max_norm)
    assert all(torch.equal(a, g) for a, (_, g) in zip(grads, opt._grads.to_step()))
    assert torch.isfinite(opt.clip_grad_norm_(math.inf))  # inf: the norm, unclipped


@pytest.mark.parametrize("norm_type", ["fro", -1.0, 0, None])
def test_norms_refuse_an_order_that_is_no_norm(norm_type):
    model = _model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0)
    model(torch.randn(2, 16)).sum().backward()
    for call in (lambda: opt.grad_norm(norm_type), lambda: opt.clip_grad_norm_(1.0, norm_type)):
        with pytest.raises(ValueError, match=r"norm_type=.*: give a positive p-norm order such as 2.0, or 'inf'"):
            call()
    # What torch's clip_grad_norm_ takes besides 2: another order, and inf as a float or a word.
    reference = [p.grad.clone() for p in model.parameters()]
    for order in (1.0, math.inf, "inf"):
        expected = torch.nn.utils.get_total_norm(reference, norm_type=order)
        torch.testing.assert_close(opt.grad_norm(order), expected)


@pytest.mark.parametrize("factor", [math.nan, math.inf, -math.inf])
def test_scaling_refuses_a_factor_that_is_not_finite(factor):
    model = _model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0, offload_gradients=True)
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(ValueError, match=r"factor=.*: give a finite number"):
        opt.scale_grads_(factor)
    opt.scale_grads_(0.5)
    opt.scale_grads_(torch.tensor(2.0))  # a tensor is taken as given


def test_a_checkpoint_one_base_optimizer_refuses_loads_nothing():
    # Before: the slots before the refusing one had the checkpoint's states, the rest their own,
    # and the groups the checkpoint's learning rate.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Linear(16, 16))  # 1024 and 256 elements
    model[1].forward = lambda x: x  # the second layer only holds parameters

    def train(opt, steps):
        for _ in range(steps):
            model[0](torch.randn(2, 16)).square().sum().backward()
            model[1].weight.grad = torch.randn(16, 16)
            model[1].bias.grad = torch.randn(16)
            opt.step()
            opt.zero_grad()

    def build(min_8bit_size, lr):
        return OffloadOptimizer(model.named_parameters(), "torchtune_offload.AdamW8bit", minimal_size=0,
                                min_8bit_size=min_8bit_size, lr=lr)

    saved = build(1000, 0.001)
    train(saved, 3)
    checkpoint = saved.state_dict()
    # 1024 elements are 8-bit either way; 256 are 8-bit only under min_8bit_size=100: the second
    # layer's base optimizer refuses its saved fp32 state, after the first layer's have loaded.
    resumed = build(100, 0.123)
    train(resumed, 1)
    before = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.optimizer.state[s.step_param].items()}
              for s in resumed._slots]
    with pytest.raises(ValueError, match=r"1.weight: .*state1 is torch.float32\[16, 16\].*Nothing was loaded"):
        resumed.load_state_dict(checkpoint)
    assert resumed.param_groups[0]["lr"] == 0.123
    for slot, old in zip(resumed._slots, before):
        state = slot.optimizer.state[slot.step_param]
        assert state["step"] == old["step"] == 1, slot.key
        assert all(torch.equal(state[k], v) for k, v in old.items() if torch.is_tensor(v)), slot.key
    train(resumed, 1)  # and it trains on from its own states
    assert resumed._slots[0].optimizer.state[resumed._slots[0].step_param]["step"] == 2


@pytest.mark.parametrize("group, expected", [
    ({"lr": -1.0}, r"optimizer.lr=-1.0 \(param group 1\) must be a number in \[0.0, inf\]"),
    ({"betas": (1.5, 0.9)}, r"optimizer.betas\[0\]=1.5 \(param group 1\) must be a number in \[0.0, 1.0\)"),
    ({"betas": (0.9,)}, r"optimizer.betas=\(0.9,\) \(param group 1\) must be two numbers"),
    ({"eps": -1.0}, r"optimizer.eps=-1.0 \(param group 1\)"),
    ({"weight_decay": math.nan}, r"optimizer.weight_decay=nan \(param group 1\)"),  # was: no decay
    ({"lr": "x"}, r"optimizer.lr='x' \(param group 1\)"),  # was: a failure at the first step
    ({"lrr": 0.1}, r"optimizer \(param group 1\): AdamW8bit takes no option 'lrr'"),  # was: ignored
])
def test_adamw8bit_checks_each_param_groups_options(group, expected):
    from torchtune_offload import AdamW8bit
    model = _model()
    with pytest.raises(ValueError, match=expected):
        AdamW8bit([{"params": model[0].parameters()}, {"params": model[1].parameters(), **group}])
    opt = AdamW8bit([{"params": model[0].parameters()}])
    with pytest.raises(ValueError, match=expected):
        opt.add_param_group({"params": model[1].parameters(), **group})
    assert len(opt.param_groups) == 1


def test_adamw8bit_refuses_a_state_dict_whose_groups_it_would_refuse():
    from torchtune_offload import AdamW8bit
    model = _model()
    opt = AdamW8bit(model.parameters(), lr=0.01)
    _train(model, opt, 1)
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = -5.0
    with pytest.raises(ValueError, match=r"optimizer.lr=-5.0 \(param group 0 of the state dict\)"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 0.01


@pytest.mark.parametrize("options, expected", [
    (dict(overlap=True, overlap_timeout_s=math.inf), "optimizer.overlap_timeout_s=inf must be a positive number"),
    (dict(overlap_timeout_s=30.0), r"optimizer.overlap_timeout_s=30.0 without optimizer.overlap=True"),
    (dict(update_on="device", device_staging_mib=math.inf), "optimizer.device_staging_mib=inf must be a positive"),
    (dict(optimizer_class="torch.optim.LBFGS"), "its step\\(\\) needs a closure"),
    (dict(offload_gradients=True, handoff="layer"), "optimizer.handoff='layer': use 'group'"),
    (dict(handoff="parameter"), "optimizer.handoff=parameter without optimizer.offload_gradients=True or "
                                "optimizer.overlap=True"),
    (dict(update_on="device", overlap=True, handoff="parameter"), "optimizer.update_on=device with "
                                                                  "optimizer.handoff=parameter"),
])
def test_engine_options_that_would_fail_or_be_ignored_later_are_refused(options, expected):
    # Before: inf failed at the first overlapped wait (or as an OverflowError), the timeout without
    # overlap bounded nothing, and LBFGS failed at the first step for want of a closure.
    with pytest.raises(ValueError, match=expected):
        OffloadOptimizer(_model().named_parameters(), minimal_size=0, **options)


@pytest.mark.parametrize("options, expected", [
    (dict(offload_gradients="false"), "optimizer.offload_gradients='false' must be True or False"),
    (dict(minimal_size="4096"), "optimizer.minimal_size='4096' must be a non-negative integer"),
])
def test_torchaos_wrapper_checks_its_own_options_on_any_machine(options, expected):
    from torchtune_offload import CPUOffloadOptimizer
    from torchtune_offload.optim import ao_offload
    model = _model()
    # The check comes before the device check, and before any hook is left on a parameter.
    with pytest.raises(ValueError, match=expected):
        CPUOffloadOptimizer(model.named_parameters(), **options)
    with pytest.raises(ValueError, match=expected):
        CPUOffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda", **options)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert ao_offload.CPUOffloadOptimizer is CPUOffloadOptimizer


@pytest.mark.parametrize("options, expected", [
    (dict(minimal_size=-1), "optimizer.minimal_size=-1"),
    (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps=0 must be an integer >= 1"),
    (dict(offload_gradients="yes"), "optimizer.offload_gradients='yes' must be True or False"),
    (dict(update_on="bogus"), "optimizer.update_on='bogus'"),
    (dict(grad_sum_on="bogus"), "optimizer.grad_sum_on='bogus'"),
    (dict(device_weights="fp9"), "optimizer.device_weights='fp9'"),
    (dict(lr=-1.0), "optimizer.lr=-1.0"),
    (dict(lrr=0.1), "optimizer.lrr=0.1"),
])
def test_the_host_memory_plan_refuses_what_the_constructor_refuses(options, expected):
    # Before: each was planned (update_on='bogus' as the host engine, grad_sum_on='bogus' as the device ring).
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    with pytest.raises(ValueError, match=expected):
        OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda", **options)
    assert OffloadOptimizer.plan_host_memory(model.named_parameters(), device="cuda").total > 0


def test_adamw8bit_groups_may_carry_torchs_bookkeeping():
    # A scheduler's initial_lr and named parameters' names are not options.
    from torchtune_offload import AdamW8bit
    model = _model()
    opt = AdamW8bit([{"params": list(model.parameters()), "initial_lr": 0.01, "param_names": ["a", "b", "c", "d"]}])
    assert opt.param_groups[0]["initial_lr"] == 0.01


def test_group_checks_skip_frozen_groups_and_see_the_host_steps_options():
    model = _model()
    model[1].requires_grad_(False)
    frozen = {"params": list(model[1].named_parameters()), "lr": -1.0}
    # A group with nothing to train is skipped, as the table skips it.
    opt = OffloadOptimizer([{"params": list(model[0].named_parameters())}, frozen], minimal_size=0)
    assert len(opt.param_groups) == 1
    # A group after a frozen one keeps its number.
    with pytest.raises(ValueError, match=r"OffloadOptimizer param group 1 \(base AdamW\)"):
        OffloadOptimizer([frozen, {"params": list(model[0].named_parameters()), "lr": -2.0}], minimal_size=0)
    # On an accelerator the host step adds fused=True, which torch refuses beside foreach=True,
    # given for a group or for all.
    groups = [{"params": list(model[0].named_parameters()), "foreach": True}]
    param_table.check_groups(groups, base_class=torch.optim.AdamW, options={})
    with pytest.raises(ValueError, match=r"param group 0 \(base AdamW, host step\)"):
        param_table.check_groups(groups, base_class=torch.optim.AdamW, options={}, host_options={"fused": True})
    plain = [{"params": list(model[0].named_parameters())}]
    with pytest.raises(ValueError, match=r"OffloadOptimizer \(base AdamW, host step\)"):
        param_table.check_groups(plain, base_class=torch.optim.AdamW, options={"foreach": True},
                                 host_options={"foreach": True, "fused": True})


def test_the_host_memory_plan_refuses_a_tensor_given_twice_and_a_groups_option():
    with torch.device("meta"):
        model = nn.Linear(4096, 4096)
    with pytest.raises(ValueError, match="one tensor is given as 'weight' and as 'again'"):
        OffloadOptimizer.plan_host_memory([*model.named_parameters(), ("again", model.weight)], device="cuda")
    with pytest.raises(ValueError, match=r"optimizer.lr=-1.0: OffloadOptimizer param group 0"):
        OffloadOptimizer.plan_host_memory([{"params": list(model.named_parameters()), "lr": -1.0}], device="cuda")


def test_a_failure_that_is_not_the_checkpoints_puts_back_the_states_and_is_raised_as_it_is(monkeypatch):
    model = _model()
    opt = OffloadOptimizer(model.named_parameters(), minimal_size=0)
    _train(model, opt, 2)
    saved = opt.state_dict()
    _train(model, opt, 1)
    slots = opt._slots
    before = [s.optimizer.state for s in slots]
    last = slots[-1].optimizer

    def out_of_memory(state_dict):
        raise torch.OutOfMemoryError("no room")

    monkeypatch.setattr(last, "load_state_dict", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError, match="no room"):
        opt.load_state_dict(saved)
    assert all(s.optimizer.state is old for s, old in zip(slots, before))
    assert all(s.optimizer.state[s.step_param]["step"] == 3 for s in slots[:-1])


def test_without_a_host_step_the_host_steps_options_are_not_checked():
    # update_on="device" steps on the device: foreach=True there is torch's business, and fine.
    model = _model()
    groups = [{"params": list(model.named_parameters()), "lr": 0.1}]
    table = param_table.ParameterTable(groups, base_class=torch.optim.AdamW, options={"foreach": True},
                                       accelerator=True, minimal_size=0, master_dtype=None, grad_sum_dtype=None,
                                       pinning="none", update_on="device")
    assert len(table.slots) == 4
