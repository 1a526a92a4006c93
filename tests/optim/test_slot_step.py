"""slot_step: a host gradient sum wider than its parameter (``grad_sum_dtype: fp32`` without
masters) is rounded to the parameter's dtype before the step into a buffer kept from step to step
(a new tensor each step is fresh memory, whose page faults cost more than the rounding), with the
bits ``grad.to(dtype)`` gives."""

import pytest
import torch

from tests.optim.side_by_side import assert_same_params, batches, tiny_model, twin
from tests.optim.test_overlap import MINIMAL_SIZE, train_windows
from torchtune_offload import OffloadOptimizer
from torchtune_offload.optim import slot_step


def _run(model, data, *, overlap, optimizer_class="torch.optim.AdamW", seen=None):
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, overlap=overlap, offload_gradients=True,
                           grad_sum_dtype="fp32", minimal_size=MINIMAL_SIZE, lr=1e-2, weight_decay=0.1)
    opt.register_forward_waits(model)
    if seen is not None:
        for slot in opt._table.offloaded:
            step = slot.optimizer.step

            def recorded(*args, _slot=slot, _step=step, **kwargs):
                seen.append(_slot.step_param.grad.data_ptr())
                return _step(*args, **kwargs)

            slot.optimizer.step = recorded
    train_windows(model, opt, data, grad_accum=3, clip=0.5)
    buffers = dict(opt._stepper._narrowed)
    opt.close()
    return buffers


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("optimizer_class", ["torch.optim.AdamW", "torchtune_offload.AdamW8bit"])
def test_wider_sums_step_from_one_kept_buffer_with_the_bits_of_to(monkeypatch, overlap, optimizer_class):
    base = tiny_model().to(torch.bfloat16)
    data = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in batches(num=9)]
    kept, seen = twin(base), []
    buffers = _run(kept, data, overlap=overlap, optimizer_class=optimizer_class, seen=seen)
    (buffer,) = buffers.values()
    assert buffer.dtype == torch.bfloat16
    assert buffer.numel() == max(p.numel() for p in base.parameters() if p.numel() >= MINIMAL_SIZE)
    # Three steps of every offloaded parameter, each on a gradient inside the one buffer.
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert len(seen) == 3 * sum(p.numel() >= MINIMAL_SIZE for p in base.parameters())
    assert all(start <= ptr < end for ptr in seen)
    # Without the buffer each step rounds into a new tensor (what the engine did before): the same bits.
    monkeypatch.setattr(slot_step, "narrowing_buffers", lambda offloaded: {})
    fresh = twin(base)
    assert _run(fresh, data, overlap=overlap, optimizer_class=optimizer_class) == {}
    assert_same_params(kept, fresh, rtol=0, atol=0)


def test_no_buffer_where_nothing_is_narrowed():
    model = tiny_model().to(torch.bfloat16)
    for options in ({}, {"grad_sum_dtype": "fp32", "master_dtype": "fp32"}):
        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", offload_gradients=True,
                               minimal_size=MINIMAL_SIZE, lr=1e-2, **options)
        assert opt._stepper._narrowed == {} and opt._stepper.narrowing_bytes == 0
        opt.close()
