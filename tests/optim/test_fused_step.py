"""The one-pass fp32-master AdamW step against torch's Adam/AdamW fed the same widened gradients."""

import shlex

import pytest
import torch

from tests.optim import float_range
from torchtune_offload.optim import fused_step

#: The pass is built with the system C compiler; without one the engine falls back (tested below).
needs_compiler = pytest.mark.skipif(fused_step.c_compiler() is None, reason="no C compiler here")

N = 4099  # not a multiple of any vector width


def _pair(cls, grad_dtype, **options):
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(N, generator=gen)
    ours = torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.clone())
    opts = [cls([p], lr=1e-2, foreach=False, **options) for p in (ours, ref)]
    grads = [(torch.randn(N, generator=gen) * 10 ** -i).to(grad_dtype) for i in range(4)]
    return ours, ref, opts, grads


@needs_compiler
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cls,options", [
    (torch.optim.AdamW, {"weight_decay": 0.1}),
    (torch.optim.AdamW, {"weight_decay": 0.0, "betas": (0.3, 0.6)}),  # lerp's other formula
    (torch.optim.Adam, {"weight_decay": 0.1}),  # L2 decay through the gradient
])
def test_matches_torch_fed_the_widened_gradient(grad_dtype, cls, options):
    ours, ref, (opt, ref_opt), grads = _pair(cls, grad_dtype, **options)
    for i, grad in enumerate(grads):
        for group in (opt.param_groups[0], ref_opt.param_groups[0]):
            group["lr"] = 1e-2 / (i + 1)  # a scheduler between steps
        out = torch.empty(N, dtype=torch.bfloat16)
        assert fused_step.supports(opt, grad, out)
        assert fused_step.fused_adamw_step(opt, grad, out)
        ref.grad = grad.float()
        ref_opt.step()
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            # torch's vectorised lerp and addcmul may use fused multiply-adds: a last-bit difference
            # that grows relatively where lerp's difference cancels.
            torch.testing.assert_close(opt.state[ours][key], ref_opt.state[ref][key], rtol=1e-4, atol=1e-7)
        assert float(opt.state[ours]["step"]) == float(ref_opt.state[ref]["step"]) == i + 1
        assert torch.equal(out, ours.detach().to(torch.bfloat16))  # torch's round-to-nearest-even


@needs_compiler
def test_writes_the_rounded_master_over_the_gradient_it_consumed():
    ours, ref, (opt, ref_opt), grads = _pair(torch.optim.AdamW, torch.bfloat16, weight_decay=0.1)
    grad = grads[0].clone()
    assert fused_step.fused_adamw_step(opt, grad, grad)
    ref.grad = grads[0].float()
    ref_opt.step()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(grad, ours.detach().to(torch.bfloat16))


@needs_compiler
def test_adam_without_weight_decay_leaves_an_infinite_weight_out_of_the_gradient():
    # torch's Adam adds weight_decay * param to the gradient only when weight_decay != 0.
    ours, ref = (torch.nn.Parameter(torch.tensor([float("inf"), 1.0])) for _ in range(2))
    opt, ref_opt = (torch.optim.Adam([p], lr=0.1, weight_decay=0.0, foreach=False) for p in (ours, ref))
    grad = torch.tensor([0.5, 0.5])
    assert fused_step.fused_adamw_step(opt, grad, torch.empty(2, dtype=torch.bfloat16))
    ref.grad = grad.clone()
    ref_opt.step()
    assert torch.equal(opt.state[ours]["exp_avg"], ref_opt.state[ref]["exp_avg"])
    assert torch.equal(ours.detach(), ref.detach())


@needs_compiler
def test_rounding_keeps_nan_and_infinities():
    p = torch.nn.Parameter(torch.tensor([1.0, float("inf"), float("nan"), -float("inf"), 3.0]))
    opt = torch.optim.AdamW([p], lr=0.0, weight_decay=0.0)
    out = torch.empty(5, dtype=torch.bfloat16)
    assert fused_step.fused_adamw_step(opt, torch.zeros(5), out)
    assert torch.equal(out[[0, 1, 3, 4]], p.detach()[[0, 1, 3, 4]].to(torch.bfloat16))
    assert out[2].isnan()


@pytest.mark.parametrize("case", ["amsgrad", "maximize", "fp16 out", "fp16 grad", "non-contiguous", "sgd",
                                  "strided state"])
def test_supports_only_what_it_reproduces(case):
    p = torch.nn.Parameter(torch.randn(8, 8))
    grad, out = torch.randn(8, 8, dtype=torch.bfloat16), torch.empty(8, 8, dtype=torch.bfloat16)
    options = {"amsgrad": True} if case == "amsgrad" else {"maximize": True} if case == "maximize" else {}
    opt = (torch.optim.SGD([p], lr=0.1) if case == "sgd" else torch.optim.AdamW([p], lr=0.1, **options))
    if case == "fp16 out":
        out = out.half()
    if case == "fp16 grad":
        grad = grad.half()
    if case == "non-contiguous":
        grad = torch.randn(8, 8, dtype=torch.bfloat16).t()
    if case == "strided state":  # as a state loaded from a checkpoint of a transposed buffer
        opt.state[p].update(step=torch.tensor(1.0), exp_avg=torch.zeros(8, 8).t(), exp_avg_sq=torch.zeros(8, 8))
    plain = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8, 8))], lr=0.1)
    assert fused_step.supports(plain, torch.randn(8, 8, dtype=torch.bfloat16), torch.empty(8, 8, dtype=torch.bfloat16))
    assert not fused_step.supports(opt, grad, out)


@needs_compiler
def test_a_compiler_given_with_arguments_is_split(monkeypatch):
    monkeypatch.setenv("CC", f"env {shlex.join(fused_step.c_compiler())}")  # as CC="ccache gcc" would be given
    fused_step._library.cache_clear()
    try:
        assert fused_step._library() is not None
    finally:
        fused_step._library.cache_clear()


def test_without_a_compiler_it_declines_once_with_a_warning_and_changes_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    fused_step._library.cache_clear()
    try:
        p = torch.nn.Parameter(torch.randn(N))
        before = p.detach().clone()
        opt = torch.optim.AdamW([p], lr=0.1)
        grad, out = torch.randn(N, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
        with pytest.warns(UserWarning, match="could not be built"):
            assert not fused_step.fused_adamw_step(opt, grad, out)
        assert not fused_step.fused_adamw_step(opt, grad, out)  # no second warning, no second build
        assert torch.equal(p.detach(), before) and not opt.state[p]
    finally:
        fused_step._library.cache_clear()


@needs_compiler
def test_a_source_that_does_not_build_is_refused_with_the_compilers_error_line(tmp_path):
    source = tmp_path / "broken.c"
    source.write_text("int ok;\n#error this build lacks what it needs\n")
    with pytest.raises(RuntimeError, match=r"broken\.c:2:\d+: error: .*this build lacks what it needs$"):
        fused_step.build_library(source)


@needs_compiler
@pytest.mark.streams_as_is  # the passes run in child processes
def test_every_build_over_the_float_range():
    """tests/optim/float_range.py's cases (gradients from 0 through the subnormal range to 1e30, zero
    blocks, single infinities and NaNs, lengths off the vector widths, bf16 and fp32, clipping, zero
    gradients after) in child processes, on every build this CPU runs: no crash, and torch's AdamW
    within this file's tolerance (its absolute part scaled with the gradients), NaN and infinities in
    the same places."""
    failures = float_range.run_in_children("fused_adamw")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
