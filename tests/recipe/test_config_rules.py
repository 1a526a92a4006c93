"""Config rules that moved before any weight is read (collate_fn), settings the recipes and the
planner read instead of the raw config (offload_gradients), and the recipes' optimizer interface:
kinds of checkpointed optimizer states are values, and each kind's adapter answers the same calls."""

import copy

import pytest
import torch
from omegaconf import OmegaConf

import torchtune_offload

from tests.recipe.test_config_check import _cfg, _problems
from tests.torchao_on_cpu import torchao_on_cpu
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import capabilities_of
from torchtune_offload.recipe import (
    HoldingOptimizer,
    OptimizerKind,
    OwnGradientsOptimizer,
    RunOptimizer,
    build_optimizer,
    check_recipe_config,
    describe_optimizer,
)

OURS = "optimizer._component_=torchtune_offload.OffloadOptimizer"


def test_a_left_padding_collate_is_refused_by_the_config_check():
    message = _problems("full", "collate_fn=torchtune.data.left_pad_sequence")
    assert "collate_fn=torchtune.data.left_pad_sequence" in message
    assert "Use torchtune.data.padded_collate_sft" in message


def test_a_collate_fn_that_does_not_import_is_refused_by_the_config_check():
    message = _problems("lora", "collate_fn=torchtune.data.padded_collate_sfft")
    assert "collate_fn=torchtune.data.padded_collate_sfft: cannot be imported" in message


@pytest.mark.parametrize("overrides, expected", [
    ((), False),
    ((OURS,), False),
    ((OURS, "optimizer.offload_gradients=True"), True),
    ((OURS, "optimizer.offload_gradients=False"), False),
])
def test_offload_gradients_reaches_the_settings(overrides, expected):
    assert check_recipe_config(_cfg("full", *overrides), recipe="full").optimizer.offload_gradients is expected


def _params():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    model(torch.randn(4, 64)).sum().backward()
    return model


def test_kinds_of_saved_states_are_told_apart_by_layout():
    model = _params()
    plain = torch.optim.AdamW(model.parameters())
    ours = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=0)
    assert OptimizerKind.of_state(plain.state_dict()) is OptimizerKind.PLAIN
    assert OptimizerKind.of_state(ours.state_dict()) is OptimizerKind.OFFLOAD_ENGINE
    assert OptimizerKind.of_state({"weight": {}}) is OptimizerKind.IN_BACKWARD
    assert OptimizerKind.of_state([1, 2]) is None


def test_a_state_of_another_kind_is_refused_naming_both_kinds():
    model = _params()
    ours = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", minimal_size=0)
    plain = RunOptimizer(torch.optim.AdamW(model.parameters()), params=model.parameters(), clip_grad_norm=None,
                         kind=OptimizerKind.PLAIN)
    with pytest.raises(ValueError, match="written by torchtune_offload.OffloadOptimizer.*run's optimizer is a plain"):
        plain.load_state_dict(ours.state_dict(), component="torch.optim.AdamW")


def test_every_kind_answers_the_loops_calls():
    model = _params()
    plain = RunOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), params=model.parameters(),
                         clip_grad_norm=None, kind=OptimizerKind.PLAIN)
    holding = HoldingOptimizer(OffloadOptimizer(model.named_parameters(), "torch.optim.SGD", lr=0.1, minimal_size=0),
                               model=model, clip_grad_norm=1.0)
    for run in (plain, holding):
        run.before_final_backward()
        run.synchronize()
        assert isinstance(run.timings(), dict)
        assert set(run.parts()) == {None}
        run.close()
    assert plain.memory_report() is None and holding.memory_report().num_offloaded == 2
    assert plain.name == "SGD" and holding.name == "OffloadOptimizer (offload; base SGD)"
    overlapped = OffloadOptimizer(model.named_parameters(), "torch.optim.SGD", lr=0.1, minimal_size=0, overlap=True,
                                  master_dtype="fp32", offload_gradients=True)
    assert (HoldingOptimizer(overlapped, model=model, clip_grad_norm=None).name
            == "OffloadOptimizer (offload; base SGD; offload_gradients, overlap, master_dtype=fp32)")
    overlapped.close()


@pytest.mark.parametrize("overrides, adapter, kind", [
    ((), RunOptimizer, OptimizerKind.PLAIN),
    ((OURS, "optimizer.overlap=True"), HoldingOptimizer, OptimizerKind.OFFLOAD_ENGINE),
    (("optimizer._component_=torchtune_offload.CPUOffloadOptimizer", "optimizer.minimal_size=1024",
      "optimizer.offload_gradients=True"), OwnGradientsOptimizer, OptimizerKind.TORCHAO_OFFLOAD),
])
def test_build_optimizer_picks_the_adapter_by_what_the_optimizer_is(monkeypatch, overrides, adapter, kind):
    """Both offloaders hold their gradients; only the engine has the calls HoldingOptimizer makes."""
    torchao_on_cpu(monkeypatch)
    model = _params()
    model.zero_grad()
    ref = copy.deepcopy(model)
    settings = check_recipe_config(_cfg("full", *overrides), recipe="full")
    run = build_optimizer(_cfg("full", *overrides).optimizer, model, settings)
    assert type(run) is adapter and run.kind is kind
    x = torch.randn(4, 64)
    ref(x).square().sum().backward()
    run.before_final_backward()
    model(x).square().sum().backward()
    # The norm the loop logs is that of the gradients the step uses, wherever they are now.
    torch.testing.assert_close(run.step(), torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    run.synchronize()
    run.close()


@pytest.mark.parametrize("component, in_backward, kind", [
    ("torchtune_offload.OffloadOptimizer", False, OptimizerKind.OFFLOAD_ENGINE),
    ("torchtune_offload.CPUOffloadOptimizer", False, OptimizerKind.TORCHAO_OFFLOAD),
    ("torchtune_offload.AdamW8bit", False, OptimizerKind.PLAIN),
    ("torch.optim.AdamW", False, OptimizerKind.PLAIN),
    ("torch.optim.AdamW", True, OptimizerKind.IN_BACKWARD),
    ("bitsandbytes.optim.PagedAdamW8bit", False, OptimizerKind.BITSANDBYTES),
    ("bitsandbytes.optim.PagedAdamW8bit", True, OptimizerKind.IN_BACKWARD),
])
def test_the_description_names_the_kind_the_adapter_is_picked_by(component, in_backward, kind):
    if component.startswith("bitsandbytes"):
        pytest.importorskip("bitsandbytes")
    cfg = OmegaConf.create({"_component_": component, "lr": 1e-3})
    chosen = describe_optimizer(cfg, in_backward=in_backward)
    assert chosen.kind is kind and chosen.component == component
    assert chosen.kind.offloads is capabilities_of(chosen.optimizer_class).offloads
    # The offloaders' own options are typed; the base optimizer gets the rest.
    assert (chosen.offload is not None) is kind.offloads
    assert dict(chosen.base_options) == {"lr": 1e-3}
    assert chosen.base_class is (torch.optim.AdamW if kind.offloads else chosen.optimizer_class)


def test_a_description_with_options_changed_is_described_anew():
    chosen = describe_optimizer(OmegaConf.create({"_component_": "torchtune_offload.OffloadOptimizer", "lr": 1e-3,
                                                  "offload_gradients": True, "grad_sum_on": "device"}),
                                in_backward=False)
    assert chosen.offload_gradients and chosen.offload.grad_sum_on == "device"
    device = chosen.with_options(update_on="device", offload_gradients=False, grad_sum_on=None)
    assert device.offload.update_on == "device" and not device.offload_gradients and device.offload.grad_sum_on == "host"
    assert dict(device.base_options) == {"lr": 1e-3}
    with pytest.raises(ValueError, match=r"optimizer\.update_on=device with optimizer\.offload_gradients=True"):
        chosen.with_options(update_on="device", grad_sum_on=None)
    assert chosen.identity == {"component": "torchtune_offload.optim.offload_optimizer.OffloadOptimizer",
                               "optimizer_class": "torch.optim.adamw.AdamW"}


def test_a_bitsandbytes_checkpoint_has_a_plain_layout_and_loads_in_a_bitsandbytes_run():
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Linear(4, 4)
    params = list(model.parameters())
    saved = bnb.optim.AdamW(params, lr=1e-3)
    assert OptimizerKind.of_state(saved.state_dict()) is OptimizerKind.PLAIN is OptimizerKind.BITSANDBYTES.layout
    run = RunOptimizer(bnb.optim.AdamW(params, lr=1e-3), params=params, clip_grad_norm=None,
                       kind=OptimizerKind.BITSANDBYTES)
    run.load_state_dict(saved.state_dict(), component="bitsandbytes.optim.AdamW")
    plain = RunOptimizer(torch.optim.AdamW(params, lr=1e-3), params=params, clip_grad_norm=None,
                         kind=OptimizerKind.PLAIN)
    with pytest.raises(ValueError, match="a plain optimizer with the options"):
        plain.load_state_dict(saved.state_dict(), component="torch.optim.AdamW")


@pytest.mark.parametrize("component", ["OffloadOptimizer", "CPUOffloadOptimizer"])
def test_the_python_api_names_a_refused_option_value_like_the_config_check(component):
    model = _params()
    with pytest.raises(ValueError, match=r"optimizer\.lr='fast': .*refuses it.*Give a number"):
        getattr(torchtune_offload, component)(model.named_parameters(), "torch.optim.AdamW", lr="fast")
