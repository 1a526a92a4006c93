"""The host C passes over the whole float range, every build this CPU runs, in child processes.

A crash in a C pass ends the process that called it, so the cases run in a child (forked by the
zygote): many cases a child, each announced on its standard output before it runs. When a child dies,
the last case it announced is the one that crashed; :func:`run_in_children` records it as a failure
and starts the next child just after it, so one crash neither ends the suite nor hides the cases
behind it. The 8-bit pass also runs in a debug build (``-DTABLE_CHECKS``) that checks every table
index it computes from data and aborts on one out of range: an out-of-range read that lands in
mapped memory does not crash, and would otherwise pass.

The cases: gradients of ``randn`` times each of :data:`SCALES` (zero, through the subnormal range, to
1e30, whose square overflows float32), each with one of :data:`SPECIALS` (a block of exact zeros, a
single infinity or NaN), of lengths that are and are not a multiple of the 256-element block and of
the vector widths, bf16 and fp32 parameters and gradients, with and without a clipping factor, over
several steps (the last ones with zero gradients, so that the moments themselves decay towards the
subnormal range); and for the 8-bit pass, blocks whose new absmax is exactly 2**-126 or 2**-128.

Each build must give the reference's result: the 8-bit pass and the host addition the same bits
where the result is not NaN and NaN in the same places (the 8-bit codes, which are never NaN, all
the same); the fp32-master pass torch's AdamW within the tolerance tests/optim/test_fused_step.py
holds it to, NaN and infinities in the same places.

Usage (what the tests run): ``python -m tests.optim.float_range PASS FIRST_CASE FIRST_BUILD [END_CASE]``;
with ``FLOAT_RANGE_CRASH_AT=CASE`` in its environment the child aborts where that case's second
build would run (the test of the crash handling itself).
"""

import ctypes
import dataclasses
import itertools
import os
import platform
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from torchtune_offload.bench.machine import cpu_flags
from torchtune_offload.optim import adamw8bit, fused_step, host_add

BF16, FP32 = torch.bfloat16, torch.float32
SCALES = (0.0, 1e-45, 1e-44, 1e-42, 1e-40, 1e-39, 2.0**-128, 1e-38, 2.0**-126, 1e-30, 1e-20, 1e-10, 1.0, 1e10,
          1e19, 1e30)
SPECIALS = ("none", "zero block", "inf", "-inf", "nan")
#: Whole blocks; a partial last block; fewer elements than a block or a 64-lane chunk.
LENGTHS = (3 * 256, 2 * 256 + 77, 37)
CLIP = 0.37
#: Gradient steps of each case: two of random gradients, then two of zeros (the moments decay).
STEPS = 4
#: The 8-bit pass's edge of the reciprocal: new absmax values put exactly there (with betas 0, the
#: first moment is the gradient and the second its square).
EXACT_ABSMAX = (2.0**-126, 2.0**-128, 2.0**-63, 2.0**-64)


@dataclasses.dataclass(frozen=True)
class Case:
    """One case: the gradients' scale and special values, the length, the dtypes and the options."""

    scale: float
    special: str
    length: int
    dtypes: Tuple[torch.dtype, torch.dtype]  # (parameter or sum, gradient or addend)
    clip: Optional[float]
    betas: Tuple[float, float] = (0.9, 0.999)
    exact_max: Optional[float] = None  # the gradient's largest magnitude, set exactly

    def __str__(self) -> str:
        dtypes = "/".join(str(d).replace("torch.", "") for d in self.dtypes)
        scale = f"max {self.exact_max!r}, betas 0" if self.exact_max is not None else f"scale {self.scale!r}"
        return f"{scale}, {self.special}, {self.length} elements, {dtypes}, clip {self.clip}"


def cases(pass_name: str) -> List[Case]:
    """The cases of one pass, in a fixed order (a child is told where to start by index)."""
    if pass_name == "host_add":
        dtypes, clips = ((BF16, BF16), (FP32, BF16), (FP32, FP32)), (None,)
    elif pass_name == "fused_adamw":
        dtypes, clips = ((FP32, BF16), (FP32, FP32)), (None, CLIP)
    else:
        dtypes, clips = ((BF16, BF16), (FP32, FP32), (FP32, BF16), (BF16, FP32)), (None, CLIP)
    out = [Case(scale, special, length, d, clip)
           for scale, special, length, d, clip in itertools.product(SCALES, SPECIALS, LENGTHS, dtypes, clips)]
    if pass_name == "adamw8bit":
        out += [Case(0.0, special, length, d, None, betas=(0.0, 0.0), exact_max=m)
                for m, special, length, d in itertools.product(EXACT_ABSMAX, ("none", "zero block"), LENGTHS[:2],
                                                               dtypes)]
    return out


def gradients(case: Case, seed: int) -> List[torch.Tensor]:
    """The case's gradients, one per step, in its gradient dtype."""
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for step in range(STEPS):
        if step >= 2:
            grads.append(torch.zeros(case.length, dtype=case.dtypes[1]))
            continue
        if case.exact_max is not None:
            g = (torch.rand(case.length, generator=gen) - 0.5) * case.exact_max
            g[step] = case.exact_max
        else:
            g = torch.randn(case.length, generator=gen) * case.scale
        if case.special == "zero block":
            g[: min(256, case.length)] = 0.0
        elif case.special != "none":
            g[(7 + 131 * step) % case.length] = {"inf": float("inf"), "-inf": -float("inf"), "nan": float("nan")}[case.special]
        grads.append(g.to(case.dtypes[1]))
    return grads


def _factor(clip: Optional[float]) -> Optional[torch.Tensor]:
    """The clipping factor the C passes take (``grad_scale``)."""
    return None if clip is None else torch.tensor(clip)


def _scaled(grad: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """The gradient the references step on: ``grad.mul_(factor)`` as clipping leaves it."""
    return grad if clip is None else grad.clone().mul_(_factor(clip))


def same_bits(ours: torch.Tensor, ref: torch.Tensor) -> str:
    """'' where ``ours`` has the bits of ``ref`` wherever ``ref`` is not NaN and NaN where it is; else
    what differs."""
    if not ours.is_floating_point():
        return "" if torch.equal(ours, ref) else f"{int((ours != ref).sum())} of {ours.numel()} differ"
    nan, ref_nan = ours.isnan(), ref.isnan()
    if not torch.equal(nan, ref_nan):
        return f"NaN at {int(nan.sum())} elements, the reference at {int(ref_nan.sum())}"
    as_int = {BF16: torch.int16, FP32: torch.int32}[ours.dtype]
    differ = ours.view(as_int)[~nan] != ref.view(as_int)[~nan]
    if differ.any():
        first = int(differ.nonzero()[0])
        return (f"{int(differ.sum())} of {ours.numel()} differ (first: {ours[~nan][first].item()!r} against "
                f"{ref[~nan][first].item()!r})")
    return ""


# ------------------------------------------------------------------------------------------- passes

def _adamw8bit_state(n: int) -> Dict[str, torch.Tensor]:
    blocks = -(-n // adamw8bit.BLOCK_SIZE)
    return {"state1": torch.zeros(n, dtype=torch.uint8), "state2": torch.zeros(n, dtype=torch.uint8),
            "absmax1": torch.zeros(blocks), "absmax2": torch.zeros(blocks)}


def _adamw8bit_trajectory(case: Case, seed: int, step: Callable) -> List[Dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed + 1)
    param = torch.randn(case.length, generator=gen).to(case.dtypes[0])
    state = _adamw8bit_state(case.length)
    group = {"betas": case.betas, "lr": 1e-3, "weight_decay": 0.01, "eps": 1e-8}
    out = []
    for number, grad in enumerate(gradients(case, seed), start=1):
        step(param, grad, state, adamw8bit.step_constants(group, number))
        out.append({"param": param.clone(), **{k: t.clone() for k, t in state.items()}})
    return out


def adamw8bit_case(case: Case, seed: int, builds: Sequence[Tuple[str, ctypes.CDLL]], announce: Callable) -> List[str]:
    """The 8-bit pass of each build against :func:`adamw8bit.reference_step_8bit`, step by step."""
    expected = _adamw8bit_trajectory(
        case, seed, lambda p, g, st, s: adamw8bit.reference_step_8bit(p, _scaled(g, case.clip), st, s))
    failures = []
    for name, library in builds:
        announce(name)
        got = _adamw8bit_trajectory(
            case, seed, lambda p, g, st, s: adamw8bit.fused_step_8bit(p, g, st, s, library=library,
                                                                     grad_scale=_factor(case.clip)))
        for number, (ours, ref) in enumerate(zip(got, expected), start=1):
            wrong = {k: why for k in ref if (why := same_bits(ours[k], ref[k]))}
            if wrong:
                failures.append(f"{name}, step {number}: " + "; ".join(f"{k} {why}" for k, why in wrong.items()))
                break
    return failures


def host_add_case(case: Case, seed: int, builds: Sequence[Tuple[str, ctypes.CDLL]], announce: Callable) -> List[str]:
    """The host addition of each build against ``dst.add_(src)``, over several additions."""
    gen = torch.Generator().manual_seed(seed + 1)
    start = (torch.randn(case.length, generator=gen) * case.scale).to(case.dtypes[0])
    grads = gradients(case, seed)
    expected, dst = [], start.clone()
    for grad in grads:
        expected.append(dst.add_(grad).clone())
    failures = []
    for name, library in builds:
        announce(name)
        dst = start.clone()
        for number, (grad, ref) in enumerate(zip(grads, expected), start=1):
            host_add.add_(dst, grad, library=library)
            if why := same_bits(dst, ref):
                failures.append(f"{name}, addition {number}: {why}")
                break
    return failures


def _close(ours: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> str:
    try:
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as err:
        return str(err).splitlines()[0]
    return ""


def fused_adamw_case(case: Case, seed: int, builds: Sequence[Tuple[str, ctypes.CDLL]], announce: Callable) -> List[str]:
    """The fp32-master pass of each build against torch's AdamW fed the widened (clipped) gradient,
    within tests/optim/test_fused_step.py's tolerance, NaN and infinities in the same places."""
    gen = torch.Generator().manual_seed(seed + 1)
    start = torch.randn(case.length, generator=gen)
    grads = gradients(case, seed)
    ref = torch.nn.Parameter(start.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    expected = []
    for grad in grads:
        ref.grad = _scaled(grad, case.clip).float()
        ref_opt.step()
        state = ref_opt.state[ref]
        expected.append((ref.detach().clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()))
    # test_fused_step.py's absolute tolerance is for gradients of order 1; where lerp's difference
    # cancels, a last-bit difference is of the order of the gradients' own last bit.
    atol = 1e-7 * max(1.0, 10 * case.scale)
    failures = []
    for name, library in builds:
        announce(name)
        ours = torch.nn.Parameter(start.clone())
        opt = torch.optim.AdamW([ours], lr=1e-2, weight_decay=0.1, foreach=False)
        for number, (grad, (p, m, v)) in enumerate(zip(grads, expected), start=1):
            out = torch.empty(case.length, dtype=BF16)
            assert fused_step.fused_adamw_step(opt, grad, out, grad_scale=_factor(case.clip), library=library)
            state = opt.state[ours]
            why = {"param": _close(ours.detach(), p, 1e-6, 1e-7), "exp_avg": _close(state["exp_avg"], m, 1e-4, atol),
                   "exp_avg_sq": _close(state["exp_avg_sq"], v, 1e-4, atol),
                   "bf16 copy": same_bits(out, ours.detach().to(BF16))}
            if any(why.values()):
                failures.append(f"{name}, step {number}: " + "; ".join(f"{k}: {w}" for k, w in why.items() if w))
                break
    return failures


RUN_CASE = {"adamw8bit": adamw8bit_case, "host_add": host_add_case, "fused_adamw": fused_adamw_case}
SOURCES = {"adamw8bit": adamw8bit.SOURCE, "host_add": host_add.SOURCE, "fused_adamw": fused_step.SOURCE}
BIND = {"adamw8bit": adamw8bit.bind_kernel, "host_add": host_add.bind_kernels, "fused_adamw": fused_step.bind_kernels}


# ------------------------------------------------------------------------------------------- builds

def builds(pass_name: str) -> Tuple[List[Tuple[str, List[str]]], List[str]]:
    """(the builds of a pass this CPU runs, as (name, compiler flags); the builds it cannot run, each
    with the reason). The flags are GCC's and clang's x86 ones, so elsewhere the native build alone runs."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return [("native", [])], ["the x86 builds (AVX-512, AVX2, portable): this is not an x86 CPU"]
    flags = cpu_flags()
    runnable, not_here = [("native", [])], []
    if pass_name != "fused_adamw" and "avx512_bf16" in flags:
        runnable.append(("without AVX512_BF16", ["-mno-avx512bf16"]))
    if "avx512f" in flags:
        runnable.append(("AVX2", ["-mno-avx512f"]))
    elif pass_name == "adamw8bit":
        not_here.append("the AVX-512 loop: this CPU lacks AVX-512 (compiled only, by the test)")
    if "avx2" in flags:
        runnable.append(("portable", ["-mno-avx2"]))
    if pass_name == "adamw8bit":  # the builds that index tables, once more with every index checked
        runnable += [(f"{name}, table checks", [*extra, "-DTABLE_CHECKS"]) for name, extra in runnable
                     if name != "without AVX512_BF16"]
    return runnable, not_here


def load(pass_name: str, extra: Sequence[str]) -> ctypes.CDLL:
    return BIND[pass_name](fused_step.build_library(SOURCES[pass_name], flags=extra))


def main(argv: Sequence[str]) -> None:
    pass_name, first_case, first_build = argv[0], int(argv[1]), int(argv[2])
    end_case = int(argv[3]) if len(argv) > 3 else None
    crash_at = int(os.environ.get("FLOAT_RANGE_CRASH_AT", -1))
    runnable, _ = builds(pass_name)
    libraries = [(name, load(pass_name, extra)) for name, extra in runnable]
    if pass_name == "adamw8bit":
        for name, library in libraries:
            print(f"built {name}: {', '.join(adamw8bit.build_paths(library)) or 'portable'}", flush=True)
    for index, case in enumerate(cases(pass_name)[:end_case]):
        if index < first_case:
            continue
        start = first_build if index == first_case else 0

        def announce(name: str, index: int = index) -> None:
            print(f"run {index} {name}", flush=True)
            if index == crash_at and name == libraries[1][0]:
                os.abort()
        for failure in RUN_CASE[pass_name](case, index, libraries[start:], announce):
            print(f"fail {index} [{case}] {failure}", flush=True)
    print("done", flush=True)


def wrong_builds(lines: Sequence[str]) -> List[str]:
    """The 8-bit builds (from a child's ``built NAME: PATHS`` lines) that did not compile the loops
    their name says: a flag the compiler ignored, or a fallback build, would test the wrong loop."""
    flags, wrong = cpu_flags(), []
    for line in lines:
        if not line.startswith("built "):
            continue
        name, paths = line[len("built "):].split(": ", 1)
        expected = {"table checks"} if "table checks" in name else set()
        if name.startswith(("native", "without AVX512_BF16")) and "avx512vbmi" in flags:
            expected.add("AVX-512")
        if name.startswith("native") and "avx512_bf16" in flags:
            expected.add("AVX512_BF16")
        if name.startswith(("native", "without AVX512_BF16", "AVX2")) and "avx2" in flags:
            expected.add("AVX2 quantizer")
        if set(paths.split(", ")) - {"portable"} != expected:
            wrong.append(f"build {name} compiled {paths}, expected {', '.join(sorted(expected)) or 'portable'}")
    return wrong


def run_in_children(pass_name: str, *, timeout: float = 600, max_crashes: int = 10, end_case: Optional[int] = None,
                    env: Optional[Dict[str, str]] = None) -> List[str]:
    """Every case of ``pass_name`` (before ``end_case``) on every build, in children forked by the zygote.

    Returns:
        One line per failure: a wrong result, or a crash (the child's exit status and the case and
        build that were running), after which the next child starts at the following build.
    """
    from tests import zygote  # the child imports this module without the test harness
    from tests.recipe_harness import REPO, working_tree_env

    runnable, _ = builds(pass_name)
    names = [name for name, _ in runnable]
    all_cases = cases(pass_name)
    failures: List[str] = []
    first = True
    case, build = 0, 0
    for _ in range(max_crashes + 1):
        command = [sys.executable, "-m", "tests.optim.float_range", pass_name, str(case), str(build)]
        done = zygote.run(command + ([] if end_case is None else [str(end_case)]), cwd=REPO,
                          env=working_tree_env(**(env or {})), capture_output=True, text=True, timeout=timeout)
        lines = done.stdout.splitlines()
        if first:
            failures += wrong_builds(lines)
            first = False
        failures += [line for line in lines if line.startswith("fail ")]
        if done.returncode == 0 and lines and lines[-1] == "done":
            return failures
        running = [line.split(" ", 2) for line in lines if line.startswith("run ")]
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        if not running:
            return failures + [f"the child exited with {done.returncode} before its first case: {tail}"]
        _, index, name = running[-1]
        failures.append(f"crash (exit status {done.returncode}) in case {index} [{all_cases[int(index)]}], build "
                        f"{name}: {tail}")
        case, build = int(index), names.index(name) + 1
        if build == len(names):
            case, build = case + 1, 0
    return failures + [f"stopped after {max_crashes} crashes"]


if __name__ == "__main__":
    main(sys.argv[1:])
