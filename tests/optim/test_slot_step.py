"""slot_step: a host gradient of another dtype than its stepped copy is converted before the step
into a buffer kept from step to step (a new tensor each step is fresh memory, whose page faults cost
more than the conversion), with the bits ``grad.to(dtype)`` gives: a sum wider than its parameter
(``grad_sum_dtype: fp32`` without masters) is rounded to it; a bf16 gradient of an fp32 master that
the fused pass does not step (AdamW8bit, or ``fused_master_step: False``) is widened to it."""

import pytest
import torch

from tests.optim.side_by_side import assert_same_params, batches, tiny_model, twin
from tests.optim.test_overlap import MINIMAL_SIZE, train_windows
from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.optim import slot_step

#: Options whose host gradients are converted before each step, and the dtype they are converted to.
CONVERTED = {
    "fp32 sums, no masters": (dict(grad_sum_dtype="fp32"), torch.bfloat16),
    "fp32 masters, unfused": (dict(master_dtype="fp32", fused_master_step=False), torch.float32),
}


def _run(model, data, *, overlap, optimizer_class="torch.optim.AdamW", seen=None, **options):
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, overlap=overlap, offload_gradients=True,
                           minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1, **options)
    opt.register_forward_waits(model)
    if seen is not None:
        for slot in opt._table.offloaded:
            step = slot.optimizer.step

            def recorded(*args, _slot=slot, _step=step, **kwargs):
                seen.append(_slot.step_param.grad.data_ptr())
                return _step(*args, **kwargs)

            slot.optimizer.step = recorded
    train_windows(model, opt, data, grad_accum=3, clip=0.5)
    buffers = dict(opt._stepper._converted)
    opt.close()
    return buffers


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("optimizer_class", ["torch.optim.AdamW", "torchtune_offload.AdamW8bit"])
@pytest.mark.parametrize("converted", list(CONVERTED))
def test_converted_gradients_step_from_one_kept_buffer_with_the_bits_of_to(monkeypatch, overlap, optimizer_class,
                                                                           converted):
    options, dtype = CONVERTED[converted]
    base = tiny_model().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(num=9)]
    kept, seen = twin(base), []
    buffers = _run(kept, data, overlap=overlap, optimizer_class=optimizer_class, seen=seen, **options)
    (buffer,) = buffers.values()
    assert buffer.dtype == dtype
    assert buffer.numel() == max(p.numel() for p in base.parameters() if p.numel() >= MINIMAL_SIZE)
    # Three steps of every offloaded parameter, each on a gradient inside the one buffer.
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert len(seen) == 3 * sum(p.numel() >= MINIMAL_SIZE for p in base.parameters())
    assert all(start <= ptr < end for ptr in seen)
    # Without the buffer each step converts into a new tensor (what the engine did before): the same bits.
    monkeypatch.setattr(slot_step, "conversion_buffers", lambda offloaded, **_: {})
    fresh = twin(base)
    assert _run(fresh, data, overlap=overlap, optimizer_class=optimizer_class, **options) == {}
    assert_same_params(kept, fresh, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"grad_sum_dtype": "fp32", "master_dtype": "fp32"},
                                     {"master_dtype": "fp32"}], ids=["bf16", "fp32 sums and masters", "fused pass"])
def test_no_buffer_where_nothing_is_converted_or_the_fused_pass_reads_the_gradient(options):
    model = tiny_model().to(torch.bfloat16)
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                           minimal_size=MINIMAL_SIZE, lr=1e-2, **options)
    assert opt._stepper._converted == {} and opt._stepper.conversion_bytes == 0
    opt.close()


def _groups(model, *, split: bool):
    """Weights and biases in one parameter group, or in two (weight decay on the weights only)."""
    named = list(model.named_parameters())
    if not split:
        return [{"params": named}]
    return [{"params": [(n, p) for n, p in named if n.endswith("weight")]},
            {"params": [(n, p) for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


#: Per case: weights and biases in two parameter groups, the base options, and the sizes of the base
#: optimizer calls of three steps.
ONE_CALL_CASES = {
    # Each Linear's weight and bias in one call.
    "one group": (False, {}, [2] * 9),
    # Options differ between the groups: each parameter alone.
    "two groups": (True, {}, [1] * 18),
    # The multi-tensor loop's temporaries cover a run: a run holds at most the largest weight's
    # bytes, which the largest weight and its bias exceed.
    "foreach": (False, {"foreach": True}, [1] * 6 + [2] * 6),
    # AdamW8bit (8-bit moments for the weights, fp32 for the biases) takes the clipping factor in its step.
    "AdamW8bit": (False, {"min_8bit_size": 1000}, [2] * 9),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", list(ONE_CALL_CASES))
def test_a_modules_slots_step_in_one_call_with_the_base_optimizers_bits(monkeypatch, overlap, case):
    """Every parameter offloaded: each Linear's weight and bias are one module's run, stepped by one
    call of the weight's base optimizer, with the bits of the base optimizer alone (torch's AdamW or
    AdamW8bit over the whole model), clipping and accumulation included. (Modules a step job takes
    one at a time here; small ones joined: the next test.)"""
    monkeypatch.setattr(slot_step, "STEP_JOB_BYTES", 0)
    split, options, expected = ONE_CALL_CASES[case]
    assert _base_calls(monkeypatch, overlap=overlap, split=split, options=options,
                       base_class=AdamW8bit if case == "AdamW8bit" else torch.optim.AdamW) == expected


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("base_class", [torch.optim.AdamW, AdamW8bit])
def test_small_modules_step_together_in_one_call_with_the_base_optimizers_bits(monkeypatch, overlap, base_class):
    """Consecutive modules of at most STEP_JOB_BYTES of parameters (the tiny model's three Linears)
    are one host step: one base-optimizer call a window, with the base optimizer's bits."""
    options = {"min_8bit_size": 1000} if base_class is AdamW8bit else {}
    assert _base_calls(monkeypatch, overlap=overlap, split=False, options=options, base_class=base_class) == [6] * 3


def _base_calls(monkeypatch, *, overlap, split, options, base_class) -> list:
    """Trains plain ``base_class`` and the engine over it side by side (three windows of three
    micro-batches, clipping), asserts the same bits, and returns the sizes of the engine's
    base-optimizer calls, sorted."""
    base = tiny_model().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(num=9)]
    plain, ours = twin(base), twin(base)

    def torch_groups(model):
        return [{**g, "params": [p for _, p in g["params"]]} for g in _groups(model, split=split)]

    reference = base_class(torch_groups(plain), lr=1e-2, weight_decay=0.1, **options)
    train_windows(plain, reference, data, grad_accum=3, clip=0.5)
    calls = []
    stepped = base_class.step

    def counted(self, *args, **kwargs):
        calls.append(len(self.param_groups[0]["params"]))
        return stepped(self, *args, **kwargs)

    opt = OffloadOptimizer(_groups(ours, split=split), base_class, overlap=overlap,
                           offload_gradients=True, minimal_size=0, lr=1e-2, weight_decay=0.1, **options)
    opt.register_forward_waits(ours)
    monkeypatch.setattr(base_class, "step", counted)
    train_windows(ours, opt, data, grad_accum=3, clip=0.5)
    assert all(slot.offloaded for slot in opt._table.slots)
    opt.close()  # after the step thread's last steps
    monkeypatch.setattr(base_class, "step", stepped)
    assert_same_params(plain, ours, rtol=0, atol=0)
    return sorted(calls)


def test_a_step_that_raises_still_sends_up_the_slots_stepped_before_it(monkeypatch):
    """A module's weight and bias in two parameter groups are two runs: where the bias's step raises,
    the weight, already stepped, has its new weights sent up and is handed to ``done``."""
    model = tiny_model().to(torch.bfloat16)
    opt = OffloadOptimizer(_groups(model, split=True), "torch.optim.AdamW", offload_gradients=True,
                           minimal_size=0, lr=1e-2)
    x, y = batches(num=1)[0]
    before = model[0].weight.detach().clone()
    ((model(x.to(torch.bfloat16)) - y.to(torch.bfloat16)) ** 2).sum().backward()
    stepper = opt._stepper
    weight, bias = opt._table.slot_of_key["0.weight"], opt._table.slot_of_key["0.bias"]
    for slot in (weight, bias):
        opt._grads.finish(slot)
    stepped = stepper.step_slot

    def failing(slot, grad, **options):
        if slot is bias:
            raise RuntimeError("the bias's step failed")
        return stepped(slot, grad, **options)

    monkeypatch.setattr(stepper, "step_slot", failing)
    done = []
    with pytest.raises(RuntimeError, match="the bias's step failed"), torch.no_grad():  # as step() runs it
        stepper.host_step([weight, bias], waited=True, done=lambda slot, event: done.append((slot, event)))
    assert [slot for slot, _ in done] == [weight]
    opt._transfer.compute_waits_for(done[0][1])
    assert not torch.equal(model[0].weight, before) and torch.equal(model[0].weight, weight.result)
    opt.close()
