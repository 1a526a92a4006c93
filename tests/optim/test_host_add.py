"""The fused host addition against torch's add_: the same bits, for every dtype pair it takes."""

import pytest
import torch

from tests.optim import float_range
from torchtune_offload.optim import host_add, stream_check
from torchtune_offload.optim.fused_step import c_compiler

needs_compiler = pytest.mark.skipif(c_compiler() is None, reason="no C compiler here")

N = 4099  # not a multiple of any vector width


def _operands(dst_dtype, src_dtype, n=N):
    gen = torch.Generator().manual_seed(0)
    dst = (torch.randn(n, generator=gen) * 3).to(dst_dtype)
    src = (torch.randn(n, generator=gen) * torch.logspace(-30, 30, n)).to(src_dtype)
    # Ties of bf16 rounding, subnormals, signed zeros, infinities and NaN.
    special = torch.tensor([1.0, 2.0**-130, -0.0, 0.0, float("inf"), -float("inf"), float("nan"), 3e38])
    dst[: len(special)] = special.to(dst_dtype)
    src[: len(special)] = torch.tensor([2.0**-8, 2.0**-131, 0.0, -0.0, 1.0, float("inf"), 1.0, 3e38]).to(src_dtype)
    return dst, src


@needs_compiler
@pytest.mark.parametrize("dst_dtype,src_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.float32)])
@pytest.mark.parametrize("n, threads", [(N, None), (host_add.PARALLEL_MIN + 5, None),  # one thread, and all of them
                                        (N, 3), (host_add.PARALLEL_MIN + 5, 1)])  # as a benchmark sets them
def test_same_bits_as_torch_add(dst_dtype, src_dtype, n, threads):
    dst, src = _operands(dst_dtype, src_dtype, n)
    ref = dst.clone().add_(src)
    assert host_add.supports(dst, src) and host_add.available()
    host_add.add_(dst, src, threads=threads)
    assert torch.equal(dst.view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32)[~ref.isnan()],
                       ref.view(torch.int16 if dst_dtype == torch.bfloat16 else torch.int32)[~ref.isnan()])
    assert torch.equal(dst.isnan(), ref.isnan())


def _every_build():
    """Every build of the loop this CPU runs (``float_range.builds``: with AVX512_BF16's rounding
    where the CPU has it, without it, and the AVX2 and portable loops)."""
    builds = [extra for _, extra in float_range.builds("host_add")[0]]
    if len(builds) < 2:
        pytest.skip("this CPU runs only the portable loop: nothing to compare it with")
    return [float_range.load("host_add", extra) for extra in builds]


@needs_compiler
def test_every_build_rounds_bf16_sums_as_torch_does():
    """The AVX512_BF16 conversion flushes denormals that torch rounds: blocks with a denormal sum,
    a zero sum, or neither, and a tail shorter than a block, give torch's bits in every build."""
    n = 32 * 40 + 7
    gen = torch.Generator().manual_seed(1)
    dst = torch.randn(n, generator=gen).bfloat16()
    src = torch.randn(n, generator=gen).bfloat16()
    tiny = torch.tensor([2.0**-130, -(2.0**-129), 2.0**-127 + 2.0**-133]).bfloat16()
    dst[5::97], src[5::97] = tiny[0], tiny[0]  # denormal sums, a few blocks apart
    dst[9::101], src[9::101] = tiny[1], tiny[2]
    dst[3::31], src[3::31] = 1.5, -1.5  # zero sums: the fast path's
    dst[-3:], src[-3:] = tiny[0], tiny[0]  # in the tail
    ref = dst.clone().add_(src)
    assert (ref[5::97].float().abs() < 2.0**-126).all() and (ref[5::97] != 0).all()
    libraries = _every_build()
    for library in libraries:
        out = dst.clone()
        library.add_bf16_bf16(out.data_ptr(), src.data_ptr(), n, 2)
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16))
    # Every bf16 bit pattern as an operand (NaN payloads, infinities, denormals): the builds agree
    # bit for bit with each other, NaNs included (torch's own NaN payloads may differ; the test above).
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    other = every[torch.randperm(every.numel(), generator=gen)]
    outs = []
    for library in libraries:
        out = every.clone()
        library.add_bf16_bf16(out.data_ptr(), other.data_ptr(), out.numel(), 2)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_other_dtypes_and_layouts_take_torch_add():
    gen = torch.Generator().manual_seed(0)
    for dst, src in [(torch.randn(64, generator=gen).half(), torch.randn(64, generator=gen).half()),
                     (torch.randn(64, generator=gen).bfloat16(), torch.randn(64, generator=gen)),  # narrowing
                     (torch.randn(8, 8, generator=gen).t(), torch.randn(8, 8, generator=gen))]:
        assert not host_add.supports(dst, src)
        ref = dst.clone().add_(src)
        host_add.add_(dst, src)
        assert torch.equal(dst, ref)


@needs_compiler
@pytest.mark.streams_as_is
def test_reports_its_accesses_to_the_stream_checker():
    with stream_check.checked_streams() as dev:
        dst = stream_check.host_tensor(torch.zeros(N))
        src = torch.ones(N, dtype=torch.bfloat16)  # device memory
        staged = stream_check.host_tensor(torch.empty(N, dtype=torch.bfloat16))
        side = dev.Stream()
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            staged.copy_(src, non_blocking=True)
        # The C loop bypasses torch's dispatcher: only its report lets the checker see this early read.
        with pytest.raises(stream_check.StreamOrderError, match="the host gradient addition"):
            host_add.add_(dst, staged)
    with stream_check.checked_streams() as dev:
        dst = stream_check.host_tensor(torch.zeros(N))
        src = torch.ones(N, dtype=torch.bfloat16)
        staged = stream_check.host_tensor(torch.empty(N, dtype=torch.bfloat16))
        side = dev.Stream()
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            staged.copy_(src, non_blocking=True)
            done = dev.Event()
            done.record()
        done.synchronize()
        host_add.add_(dst, staged)
    assert torch.equal(dst, torch.ones(N))


def test_without_a_compiler_it_warns_once_and_adds_with_torch(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    host_add._library.cache_clear()
    try:
        dst, src = _operands(torch.float32, torch.bfloat16)
        ref = dst.clone().add_(src)
        with pytest.warns(UserWarning, match="could not be built"):
            host_add.add_(dst, src)
        host_add.add_(dst, src)  # no second warning, no second build
        assert torch.equal(dst[~ref.isnan()], ref.add_(src)[~ref.isnan()])
        assert not host_add.available()
    finally:
        host_add._library.cache_clear()


@needs_compiler
@pytest.mark.streams_as_is  # the passes run in child processes
def test_every_build_over_the_float_range():
    """tests/optim/float_range.py's cases (operands from 0 through the subnormal range to 1e30, zero
    blocks, single infinities and NaNs, lengths off the vector widths, bf16 and fp32) in child
    processes, on every build this CPU runs: torch's bits, NaN in the same places, no crash."""
    failures = float_range.run_in_children("host_add")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])


@needs_compiler
@pytest.mark.streams_as_is  # the passes run in child processes
def test_a_crash_in_a_child_is_a_failure_naming_its_case_and_the_cases_after_it_still_run():
    runnable, _ = float_range.builds("host_add")
    if len(runnable) < 2:
        pytest.skip("one build here: the injected crash needs a second one")
    failures = float_range.run_in_children("host_add", end_case=4, env={"FLOAT_RANGE_CRASH_AT": "2"})
    assert len(failures) == 1 and failures[0].startswith(f"crash (exit status -6) in case 2 ["), failures
    assert f"build {runnable[1][0]}:" in failures[0]
