"""Clipping inside the host passes (``grad_scale``): a step given the clipping factor is the step
after ``grad.mul_(factor)``, to the bit, in every build of the C passes and in the references; the
gradient itself is left as it was; and the overlapped engine, which now hands the factor to the
step instead of scaling each gradient first, still gives the serial path's bits."""

import pytest
import torch

from tests.optim.side_by_side import assert_same_params, batches, tiny_model, twin
from tests.optim.test_adamw8bit import MIN_8BIT, _every_build, needs_cc
from tests.optim.test_overlap import train_windows
from torchtune_offload import AdamW8bit, OffloadOptimizer
from torchtune_offload.optim import adamw8bit, fused_step

#: Factors as clipping makes them (float32, at most 1): 3/4 turns a quarter of bf16 products into
#: exact ties between two bf16 values; 1/pi rounds in every way; 2**-120 makes float32 denormals.
FACTORS = [0.75, 1 / torch.pi, 2.0**-120, 1.0]
NUMEL = 256 * 8 + 77  # whole blocks and a partial one


def _grad(dtype: torch.dtype, *, numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    """Gradients decades apart, with zeros, bf16 denormals and exact powers of two among them."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=gen) * (torch.randn(numel, generator=gen) * 3).exp() * 1e-3
    g[::101] = 0.0
    g[1::103] = 1e-39
    g[2::107] = 2.0**-3
    return g.to(dtype)


def _factor(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _fresh_8bit_state(numel: int) -> dict:
    blocks = -(-numel // 256)
    return {"state1": torch.zeros(numel, dtype=torch.uint8), "state2": torch.zeros(numel, dtype=torch.uint8),
            "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks)}


def test_torch_rounds_a_scaled_bf16_gradient_as_the_passes_assume():
    """The passes' premise, checked on this machine's torch: ``grad.mul_(factor)`` of a bf16
    gradient is one float32 product rounded to nearest even (ties included), so
    ``mul_`` then widen equals widen, multiply in float32, round, widen."""
    g = _grad(torch.bfloat16, numel=1 << 16)
    for value, dtype in [(v, torch.float32) for v in FACTORS] + [(1 / torch.pi, torch.bfloat16)]:
        f = _factor(value, dtype)
        product = g.float() * f
        bits = product.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        expected = rounded.to(torch.int64).where(rounded < 2**31, rounded - 2**32).to(torch.int32).view(torch.float32)
        assert torch.equal(g.clone().mul_(f).float(), expected), value
        if value == 0.75:
            ties = ((bits & 0xFFFF) == 0x8000).sum()
            assert ties > 1000, "the tie case must occur for this test to mean anything"


@needs_cc
@pytest.mark.parametrize("param_dtype, grad_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                     (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_8bit_pass_with_a_factor_is_the_pass_after_mul(param_dtype, grad_dtype):
    """Every build of the 8-bit pass (AVX-512, AVX2, portable) and every factor: parameters,
    codes and absmax bit for bit with the pass fed ``grad.mul_(factor)``; the gradient unchanged."""
    constants = adamw8bit.step_constants({"betas": (0.9, 0.999), "lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8}, 1)
    for library in _every_build():
        # A bf16 factor too: a bf16 model's norm, and so its factor, is bf16.
        for value in FACTORS + [_factor(1 / torch.pi, torch.bfloat16)]:
            start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1)).to(param_dtype)
            g = _grad(grad_dtype)
            folded, scaled = start.clone(), start.clone()
            folded_state, scaled_state = _fresh_8bit_state(NUMEL), _fresh_8bit_state(NUMEL)
            grad = g.clone()
            factor = value if isinstance(value, torch.Tensor) else _factor(value)
            assert adamw8bit.fused_step_8bit(folded, grad, folded_state, constants, library=library,
                                             grad_scale=factor)
            assert adamw8bit.fused_step_8bit(scaled, g.clone().mul_(factor), scaled_state, constants,
                                             library=library)
            assert torch.equal(grad.view(torch.uint8), g.view(torch.uint8)), "the gradient must be left as it was"
            assert torch.equal(folded.view(torch.uint8), scaled.view(torch.uint8)), value
            for key in folded_state:
                assert torch.equal(folded_state[key], scaled_state[key]), (value, key)


@needs_cc
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("numel", [NUMEL, 1000])  # 8-bit states; fp32 states below min_8bit_size
@pytest.mark.parametrize("shape", [(), (1,)])  # a one-element factor need not be a scalar
def test_adamw8bit_step_with_a_factor_is_the_step_after_mul(fused, numel, shape):
    """``AdamW8bit.step(grad_scale=f)`` against ``p.grad.mul_(f); step()``, three steps, the C
    pass and the pure-torch references alike; the gradient is left unscaled."""
    start = torch.randn(numel, generator=torch.Generator().manual_seed(2)).bfloat16()
    folded, scaled = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opts = [AdamW8bit([p], lr=1e-3, min_8bit_size=MIN_8BIT, fused=fused) for p in (folded, scaled)]
    for step, value in enumerate([0.75, 1 / torch.pi, 0.3]):
        g = _grad(torch.bfloat16, numel=numel, seed=step)
        factor = _factor(value).reshape(shape)
        folded.grad = g.clone()
        opts[0].step(grad_scale=factor)
        assert torch.equal(folded.grad.view(torch.uint8), g.view(torch.uint8))
        scaled.grad = g.clone().mul_(factor)
        opts[1].step()
        assert torch.equal(folded.view(torch.uint8), scaled.view(torch.uint8))
        for key, value_ in opts[0].state[folded].items():
            other = opts[1].state[scaled][key]
            assert torch.equal(value_, other) if isinstance(value_, torch.Tensor) else value_ == other, key


@pytest.mark.parametrize("bad", [0.5, torch.tensor(0.5, dtype=torch.float64), torch.tensor([0.5, 0.5])])
def test_a_factor_that_is_no_float32_scalar_is_refused_before_any_change(bad):
    p = torch.nn.Parameter(torch.ones(300))
    p.grad = torch.ones(300)
    opt = AdamW8bit([p], lr=1e-3)
    with pytest.raises(ValueError, match="grad_scale"):
        opt.step(grad_scale=bad)
    assert torch.equal(p.detach(), torch.ones(300)) and not opt.state


@needs_cc
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_master_pass_with_a_factor_is_the_pass_after_mul(grad_dtype):
    """The fused fp32-master pass: master, moments and its bf16 rounding bit for bit with the pass
    fed ``grad.mul_(factor)``, three steps; the gradient is left as it was."""
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
    folded, scaled = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opts = [torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in (folded, scaled)]
    for step, value in enumerate(FACTORS[:3]):
        g = _grad(grad_dtype, seed=step)
        outs = [torch.empty(NUMEL, dtype=torch.bfloat16) for _ in range(2)]
        grad = g.clone()
        assert fused_step.fused_adamw_step(opts[0], grad, outs[0], grad_scale=_factor(value))
        assert fused_step.fused_adamw_step(opts[1], g.clone().mul_(_factor(value)), outs[1])
        assert torch.equal(grad.view(torch.uint8), g.view(torch.uint8))
        assert torch.equal(folded.view(torch.uint8), scaled.view(torch.uint8)), value
        assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opts[0].state[folded][key], opts[1].state[scaled][key])


@needs_cc
@pytest.mark.parametrize("master_dtype", [None, "fp32"])
@pytest.mark.parametrize("grad_sum_dtype", [None, "fp32"])
@pytest.mark.parametrize("grad_accum", [1, 3])
def test_overlapped_8bit_engine_clips_as_the_serial_one(master_dtype, grad_sum_dtype, grad_accum):
    """A bf16 model under AdamW8bit with ``offload_gradients`` and clipping that bites: the serial
    path scales every gradient in place, the overlapped one hands the factor to the pass (without
    masters) or scales first (with masters, whose gradient is widened); the weights are the same bits."""
    base = tiny_model().to(torch.bfloat16)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(num=4 * grad_accum)]
    runs = {}
    for overlap in (False, True):
        model = twin(base)
        opt = OffloadOptimizer(model.named_parameters(), "torchtune_offload.AdamW8bit", minimal_size=1000, lr=1e-2,
                               weight_decay=0.1, min_8bit_size=MIN_8BIT, offload_gradients=True, overlap=overlap,
                               master_dtype=master_dtype, grad_sum_dtype=grad_sum_dtype)
        if overlap:
            opt.register_forward_waits(model)
        norms = train_windows(model, opt, data, grad_accum=grad_accum, clip=0.05)
        opt.synchronize()
        runs[overlap] = (model, norms)
        opt.close()
    assert max(runs[False][1]) > 0.05, "the clip threshold must bite for this test to mean anything"
    assert runs[True][1] == runs[False][1]
    assert_same_params(runs[False][0], runs[True][0], rtol=0, atol=0)
