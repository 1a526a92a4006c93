"""Several slots stepped by one base-optimizer call give each the bits of its own optimizer's step."""

import pytest
import torch

from torchtune_offload import AdamW8bit
from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.optim.step_together import runs, step_together

SHAPES = [(7, 5), (3,), (16, 4), (1,)]


def _params(dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for shape in SHAPES]


def _grads(step: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(100 + step)
    # Gradients over many magnitudes, so that rounding differences would show.
    return [(torch.randn(shape, generator=gen) * 10.0 ** (step % 7 - 3)).to(dtype) for shape in SHAPES]


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("options", [dict(weight_decay=0.1), dict(weight_decay=0.1, amsgrad=True),
                                     dict(maximize=True, betas=(0.8, 0.95), eps=1e-6), dict(fused=True),
                                     dict(foreach=True, betas=(0.8, 0.95)), dict(foreach=False)])
def test_one_call_is_each_slots_own_step_bit_for_bit(cls, dtype, options):
    """Per-parameter optimizers (the slots') against the same parameters stepped by one call of the
    first one's optimizer (its options as built: single-tensor loop, foreach or fused), over 12 steps
    with an lr that changes, and the states each slot's own optimizer keeps afterwards."""
    alone = [torch.nn.Parameter(p) for p in _params(dtype)]
    together = [torch.nn.Parameter(p) for p in _params(dtype)]
    own = [cls([p], lr=1e-2, **options) for p in alone]
    slots = [cls([p], lr=1e-2, **options) for p in together]
    for step in range(12):
        for opt in own + slots:
            opt.param_groups[0]["lr"] = 1e-2 / (1 + step)
        for p, g in zip(alone, _grads(step, dtype)):
            p.grad = g
        for opt in own:
            opt.step()
        for p, g in zip(together, _grads(step, dtype)):
            p.grad = g
        after = step_together(slots[0], together, [opt.state[p] for opt, p in zip(slots, together)])
        for opt, p, state in zip(slots, together, after):
            assert state is opt.state[p]  # Adam advances the slot's own dict in place
        for a, b in zip(alone, together):
            assert torch.equal(a, b), f"step {step}"
    for opt_a, opt_b, a, b in zip(own, slots, alone, together):
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key
    # The lending optimizer is its own again: one parameter, its state.
    assert slots[0].param_groups[0]["params"] == [together[0]]
    assert list(slots[0].state) == [together[0]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "grad_scale"])
def test_adamw8bit_in_one_call_is_each_slots_own_step_bit_for_bit(dtype, scaled):
    """AdamW8bit's C pass per tensor, 8-bit moments for the two larger tensors and fp32 ones for the
    others (min_8bit_size=16), with and without a clipping factor that its step takes."""
    alone = [torch.nn.Parameter(p) for p in _params(dtype)]
    together = [torch.nn.Parameter(p) for p in _params(dtype)]
    own = [AdamW8bit([p], lr=1e-2, weight_decay=0.1, min_8bit_size=16) for p in alone]
    slots = [AdamW8bit([p], lr=1e-2, weight_decay=0.1, min_8bit_size=16) for p in together]
    for step in range(12):
        scale = {"grad_scale": torch.tensor(0.5 + step / 24)} if scaled else {}
        for p, g in zip(alone, _grads(step, dtype)):
            p.grad = g
        for opt in own:
            opt.step(**scale)
        for p, g in zip(together, _grads(step, dtype)):
            p.grad = g
        after = step_together(slots[0], together, [opt.state[p] for opt, p in zip(slots, together)], **scale)
        for opt, p, state in zip(slots, together, after):
            opt.state[p] = state
        for a, b in zip(alone, together):
            assert torch.equal(a, b), f"step {step}"
    for opt_a, opt_b, a, b in zip(own, slots, alone, together):
        for key, value in opt_a.state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b.state[b][key])), key


def test_which_optimizers_step_tensors_apart():
    class Mine(torch.optim.AdamW):
        pass

    assert capabilities_of(torch.optim.AdamW).steps_tensors_apart
    assert capabilities_of(torch.optim.Adam).steps_tensors_apart
    assert capabilities_of(AdamW8bit).steps_tensors_apart
    assert not capabilities_of(Mine).steps_tensors_apart  # a subclass may change step
    assert not capabilities_of(torch.optim.SGD).steps_tensors_apart


def test_the_lending_optimizer_is_restored_when_the_step_raises():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones(3)
    opt.step()
    before = opt.state[p]
    q.grad = torch.ones(2)
    wrong = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(5), "exp_avg_sq": torch.zeros(5)}
    with pytest.raises(RuntimeError):
        step_together(opt, [p, q], [opt.state[p], wrong])  # q's states have the wrong shape
    assert opt.param_groups[0]["params"] == [p]
    assert list(opt.state) == [p] and opt.state[p] is before


def test_runs_cut_by_key_and_bytes():
    items = [("a", 4), ("a", 4), ("a", 4), (None, 1), (None, 1), ("b", 9), ("b", 1), ("a", 1)]
    cut = runs(items, key=lambda item: item[0], nbytes=lambda item: item[1], bound=8)
    assert cut == [[("a", 4), ("a", 4)], [("a", 4)], [(None, 1)], [(None, 1)], [("b", 9)], [("b", 1)], [("a", 1)]]
    assert runs([], key=lambda item: item, nbytes=lambda item: 0, bound=0) == []
