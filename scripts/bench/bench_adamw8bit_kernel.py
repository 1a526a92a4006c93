"""Where the fused 8-bit AdamW pass spends its time, side by side with torch's fused bf16 AdamW.

Usage: python scripts/bench/bench_adamw8bit_kernel.py [--params 100e6] [--threads 1] [--rounds 10]
                                                      [--no-instructions] [--builds]

Steps one flat bf16 tensor of --params parameters (random values, gradients of 1e-3, states of two
real steps) with torch's fused AdamW (bf16 states) and with copies of the C pass of
`torchtune_offload.AdamW8bit` (`torchtune_offload/optim/fused_adamw8bit.c`): the pass itself, and
ablations built from its source with one part taken out. An ablation's results are wrong (the
near-check one's codes only one apart, on rare elements); its time is the point: what the pass
would cost without that part. All of them step once a round, in an order shuffled each round, on
--threads threads (default 1: the cost per core), and the table gives the median of --rounds
rounds after two warm-up rounds, in Mparam/s, nanoseconds per 16 elements (one AVX-512 vector of
floats) and as a ratio to torch's step in the same rounds. The ablations are of the pass's AVX-512
path: where that path does not build (no AVX-512 with VBMI: -march=native finds none on this CPU),
the script says so, points to --builds and exits with status 1.

With --builds it times, instead of the ablations, the whole pass as built for each instruction set
an x86 CPU may have: this CPU's best (-march=native), without AVX-512 (the portable loop with its
AVX2 quantizer: most desktop Intel cores, AMD's before Zen 4) and without AVX2 (the portable loop
alone). To time torch's step with the kernels it would pick on such a CPU, run the script with
ATEN_CPU_CAPABILITY=avx2 (or default) in the environment; the table's heading names the kernels
torch used.

Unless --no-instructions is given, a second table gives the throughput of the AVX-512 instructions
the pass is made of on this CPU, from a generated C loop of independent instructions (the median of
10 timed runs after one untimed; none where no compiler or no AVX-512 is found): nanoseconds per
instruction, and in cycles of the clock that a chain of dependent scalar additions shows, which is
the vector units' clock on CPUs that do not slow down for AVX-512.
"""

import argparse
import ctypes
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from torchtune_offload import AdamW8bit
from torchtune_offload.bench.arguments import positive_int, positive_number
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.optim import adamw8bit, fused_step

_NO_DIVIDER = [
    ("_mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi[k]), c2), eps)", "_mm512_add_ps(_mm512_mul_ps(vi[k], c2), eps)"),
    ("_mm512_mul_ps(_mm512_div_ps(mi[k], denom), step)", "_mm512_mul_ps(_mm512_mul_ps(mi[k], denom), step)"),
]
# The check of lanes near a midpoint: the one part only exactness needs (the issue allows codes one
# apart on 0.1% of elements).
_NO_NEAR_CHECK = ("_mm512_testn_epi32_mask(fixed, _mm512_set1_epi32((1 << FRACTION_BITS) - 2 * NEAR_UNITS))", "0")
# The requantization cut to its estimate: without the comparison with the group boundary inside a
# binade, the cap at a group's last code, the near check and the signed map's negative codes, all
# needed for right codes.
_ESTIMATE_ONLY = [
    ("    const __mmask16 above = _mm512_cmp_ps_mask(y, _mm512_permutex2var_ps(bound[0], b, bound[1]), _CMP_GT_OQ);\n"
     "    b = _mm512_mask_add_epi32(b, above, b, _mm512_set1_epi32(1));\n", ""),
    ("    fixed = _mm512_min_epi32(fixed, _mm512_permutex2var_epi32(top[0], b, top[1]));\n", ""),
    _NO_NEAR_CHECK,
    ("    if (is_signed) /* the sign bit", "    if (0) /* the sign bit"),
]
#: Each ablation: its row name and the (text, replacement) pairs that make it from the pass's source.
ABLATIONS: Dict[str, List[Tuple[str, str]]] = {
    "the pass": [],
    "without the requantization (codes left as they were)": [
        ("    quantize_block_avx512(m, new1, 1, t1, s1, q1);\n    quantize_block_avx512(v, new2, 0, t2, s2, q2);\n", ""),
    ],
    "without the square root and the division": _NO_DIVIDER,
    "requantization without the near-midpoint check": [_NO_NEAR_CHECK],
    "requantization cut to its estimate (no group boundary, cap, near check or sign)": _ESTIMATE_ONLY,
    "that, and without the square root and the division": _ESTIMATE_ONLY + _NO_DIVIDER,
}
# Appended to every copy: the ablations edit the AVX-512 path, so a copy built without it (the
# builder falls back to plainer flags) would time the portable loop under an ablation's name.
_VECTOR_PATH_REQUIRED = "\n#ifndef HAVE_AVX512_BLOCK\n#error the AVX-512 vector path is not built\n#endif\n"


#: --builds: each row's name and the compiler options after -march=native (GCC's and clang's x86 names).
BUILDS: Dict[str, Tuple[str, ...]] = {
    "the pass, built for this CPU": (),
    "the pass, built without AVX-512 (AVX2 quantizer)": ("-mno-avx512f",),
    "the pass, built without AVX2 (portable loop)": ("-mno-avx2",),
}

#: Both optimizers' options.
OPTIONS = {"lr": 1e-5, "weight_decay": 0.01}


def ablated_source(source: str, replacements: List[Tuple[str, str]]) -> str:
    """``source`` with each text replaced; a text that is not there exactly once is an error, so an
    edit of the pass cannot silently leave an ablation measuring the whole pass."""
    for old, new in replacements:
        if source.count(old) != 1:
            raise SystemExit(f"{adamw8bit.SOURCE.name} no longer holds this text exactly once; update ABLATIONS "
                             f"in {Path(__file__).name}:\n{old}")
        source = source.replace(old, new)
    return source


def build(source: str, directory: str, name: str) -> ctypes.CDLL:
    """The pass built from ``source`` as the optimizer builds it, with its argument types set."""
    path = Path(directory) / f"{name}.c"
    path.write_text(source + _VECTOR_PATH_REQUIRED)
    try:
        return adamw8bit.bind_kernel(fused_step.build_library(path))
    except RuntimeError as err:
        raise SystemExit(f"the pass's AVX-512 path does not build here (it needs AVX-512 with VBMI), so there is "
                         f"nothing to take apart; --builds times the builds this CPU runs. The compiler said: {err}")


def build_for(flags: Tuple[str, ...]) -> Optional[ctypes.CDLL]:
    """The unmodified pass built with ``flags`` after the usual ones; None (and why, on stderr) where
    the compiler refuses them."""
    try:
        return adamw8bit.bind_kernel(fused_step.build_library(adamw8bit.SOURCE, flags=flags))
    except RuntimeError as err:
        print(f"the pass with {' '.join(flags)} does not build here: {err}", file=sys.stderr)
        return None


def pass_step(library: ctypes.CDLL, param: torch.Tensor, grad: torch.Tensor, state: Dict[str, torch.Tensor],
              group: Dict[str, object]) -> Callable[[], None]:
    """One step of ``library``'s pass on these tensors, with the constants of ``group``'s third step."""
    constants = adamw8bit.step_constants(group, 3)
    return lambda: adamw8bit.fused_step_8bit(param, grad, state, constants, library=library)


def medians(steps: Dict[str, Callable[[], None]], *, rounds: int) -> Dict[str, float]:
    """Median seconds of each step over ``rounds`` rounds (after two warm-up rounds), all steps in
    each round in a shuffled order: a step may find the one before it still spinning its threads,
    and none should always follow the same one."""
    names = list(steps)
    times: Dict[str, List[float]] = {name: [] for name in names}
    order = random.Random(0)
    for r in range(rounds + 2):
        for name in order.sample(names, len(names)):
            t0 = time.perf_counter()
            steps[name]()
            if r >= 2:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


INSTRUCTIONS = {  # name: C statement on chain k (x, y, z: float; i: integer vectors)
    "vmulps": "x{k} = _mm512_mul_ps(x{k}, c);",
    "vfmadd231ps": "x{k} = _mm512_fmadd_ps(x{k}, c, c);",
    "vaddps": "x{k} = _mm512_add_ps(x{k}, c);",
    "vpaddd": "i{k} = _mm512_add_epi32(i{k}, ix);",
    "vpermt2ps (32-entry table)": "x{k} = _mm512_permutex2var_ps(x{k}, ix, c);",
    "vpermi2b (128-entry byte table)": "i{k} = _mm512_permutex2var_epi8(i{k}, ix, jx);",
    "vpermb": "i{k} = _mm512_permutexvar_epi8(ix, i{k});",
    "vpunpcklbw": "i{k} = _mm512_unpacklo_epi8(i{k}, ix);",
    "vcvttps2dq": "i{k} = _mm512_cvttps_epi32(_mm512_castsi512_ps(i{k}));",
    # An addition beside each (far cheaper) keeps the operand off an easy value such as 1.
    "vsqrtps": "x{k} = _mm512_sqrt_ps(_mm512_add_ps(x{k}, c));",
    "vdivps": "x{k} = _mm512_div_ps(x{k}, c);",
    "vsqrtps with 2 vpermt2ps beside it (time per vsqrtps)":
        "x{k} = _mm512_sqrt_ps(_mm512_add_ps(x{k}, c)); y{k} = _mm512_permutex2var_ps(y{k}, ix, c); "
        "z{k} = _mm512_permutex2var_ps(z{k}, ix, c);",
}
_CHAINS = 8
_RUNS = 10


def instruction_program() -> str:
    """C source timing each of INSTRUCTIONS on independent chains: one untimed run, then the median of
    _RUNS; then the clock. The chains are folded into the exit status and pass through an empty asm
    each iteration, so that the compiler can neither drop nor merge them."""
    lines = ["#include <immintrin.h>", "#include <stdio.h>", "#include <stdlib.h>", "#include <time.h>",
             "static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); "
             "return t.tv_sec + t.tv_nsec * 1e-9; }",
             "static int by_value(const void *a, const void *b) { const double x = *(const double *)a, "
             "y = *(const double *)b; return (x > y) - (x < y); }",
             "int main(int argc, char **argv) {",
             "  const long reps = 2000000; double sink = 0;",
             "  const __m512 c = _mm512_set1_ps(0.999999f); const __m512i ix = _mm512_set1_epi32(argc + 2), "
             "jx = _mm512_set1_epi32(argc);",
             f"  double t0, ns[{len(INSTRUCTIONS)}][{_RUNS + 1}];",
             f"  for (int run = 0; run <= {_RUNS}; run++) {{"]
    chains = range(_CHAINS)
    for n, (name, statement) in enumerate(INSTRUCTIONS.items()):
        decl = " ".join(f"__m512 x{k} = _mm512_set1_ps(1.0f + {k} * 0.001f), y{k} = x{k}, z{k} = x{k}; "
                        f"__m512i i{k} = _mm512_set1_epi32(argc + {k});" for k in chains)
        body = " ".join(statement.format(k=k) for k in chains)
        # Only the vectors the statement writes: pinning all four of every chain would take more
        # registers than there are.
        written = [v for v in "xyzi" if f"{v}{{k}} =" in statement]
        keep = " ".join('__asm__("" : ' + ", ".join(f'"+v"({v}{k})' for v in written) + ");" for k in chains)
        fold = " + ".join(f"_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(x{k}, y{k}), z{k})) + "
                          f"_mm512_reduce_add_epi32(i{k})" for k in chains)
        lines += [f"    {{ {decl}", f"      t0 = now(); for (long r = 0; r < reps; r++) {{ {body} {keep} }}",
                  f"      ns[{n}][run] = (now() - t0) / reps / {_CHAINS} * 1e9; sink += {fold}; }}"]
    lines += ["  }"]
    # The clock, measured after the instructions (the core has left any low-power state by then): a
    # chain of dependent scalar additions runs one a cycle.
    lines += ["  long a = 0; t0 = now(); for (long r = 0; r < 1000000000; r++) __asm__ volatile(\"add $1, %0\" "
              ": \"+r\"(a)); const double ghz = 1e9 / (now() - t0) / 1e9;",
              "  printf(\"clock %.2f GHz\\n\", ghz);"]
    for n, name in enumerate(INSTRUCTIONS):  # the median of the timed runs (run 0 warmed up)
        lines += [f"  qsort(ns[{n}] + 1, {_RUNS}, sizeof(double), by_value);",
                  f"  printf(\"| {name} | %.3f | %.2f |\\n\", (ns[{n}][{_RUNS // 2}] + ns[{n}][{_RUNS // 2 + 1}]) / 2, "
                  f"(ns[{n}][{_RUNS // 2}] + ns[{n}][{_RUNS // 2 + 1}]) / 2 * ghz);"]
    lines += ["  return sink == 12345.0;", "}"]
    return "\n".join(lines)


def instruction_table(directory: str) -> Optional[str]:
    """The instruction table's lines, or None where no compiler builds the AVX-512 loop here."""
    compiler = fused_step.c_compiler()
    if compiler is None:
        return None
    source, binary = Path(directory) / "instructions.c", Path(directory) / "instructions"
    source.write_text(instruction_program())
    built = subprocess.run([*compiler, "-O2", "-march=native", str(source), "-o", str(binary)], capture_output=True)
    if built.returncode != 0:
        return None
    ran = subprocess.run([str(binary)], capture_output=True, text=True)
    return ran.stdout if ran.returncode in (0, 1) else None  # the status is the chains' fold, 0 or 1


def parse_args() -> Tuple[argparse.Namespace, int]:
    """The command line, checked (a bad value exits through ``parser.error``).

    Returns:
        The options, and the parameters to step: ``--params`` in whole blocks, so that every
        element runs the vector path.
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=positive_number, default=100e6, help="parameters in the tensor (default 100e6)")
    parser.add_argument("--threads", type=positive_int, default=1, help="threads of every step (default 1)")
    parser.add_argument("--rounds", type=positive_int, default=10, help="timed rounds, after 2 warm-up (default 10)")
    parser.add_argument("--no-instructions", action="store_true", help="skip the instruction table")
    parser.add_argument("--builds", action="store_true",
                        help="time the pass built for each instruction set instead of its ablations")
    args = parser.parse_args()
    if args.rounds < 10:
        parser.error("--rounds must be at least 10")
    numel = int(args.params) // adamw8bit.BLOCK_SIZE * adamw8bit.BLOCK_SIZE  # whole blocks: the vector path
    if numel < adamw8bit.BLOCK_SIZE or args.threads < 1:
        parser.error(f"--params must be at least {adamw8bit.BLOCK_SIZE} and --threads at least 1")
    return args, numel


def main() -> None:
    args, numel = parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(numel, generator=gen).bfloat16()
    grad = (torch.randn(numel, generator=gen) * 1e-3).bfloat16()

    # torch's step, and the states of two real steps of the pass for every copy of it to start from.
    torch_param = torch.nn.Parameter(start.clone())
    torch_param.grad = grad
    torch_opt = torch.optim.AdamW([torch_param], **OPTIONS, fused=True)
    ours = torch.nn.Parameter(start.clone())
    ours.grad = grad
    opt = AdamW8bit([ours], **OPTIONS, min_8bit_size=0)  # 8-bit states whatever --params is
    if not adamw8bit.fused_available():
        raise SystemExit("the fused pass does not build here (see the warning above)")
    opt.step()
    opt.step()
    steps = {"torch fused AdamW, bf16 states": torch_opt.step}
    source = adamw8bit.SOURCE.read_text()
    with tempfile.TemporaryDirectory(prefix="bench_adamw8bit_") as directory:
        if args.builds:
            libraries = {name: build_for(flags) for name, flags in BUILDS.items()}
        else:
            libraries = {name: build(ablated_source(source, replacements), directory, f"variant{i}")
                         for i, (name, replacements) in enumerate(ABLATIONS.items())}
        for name, library in libraries.items():
            if library is None:
                continue
            state = {k: v.clone() for k, v in opt.state[ours].items() if torch.is_tensor(v)}
            steps[name] = pass_step(library, ours.detach().clone(), grad, state, opt.param_groups[0])
        seconds = medians(steps, rounds=args.rounds)
        instructions = None if args.no_instructions or args.builds else instruction_table(directory)

    base = seconds["torch fused AdamW, bf16 states"]
    print(f"{cpu_name()}, {args.threads} thread{'s' if args.threads > 1 else ''}, torch {torch.__version__} "
          f"({torch.backends.cpu.get_cpu_capability()} kernels); "
          f"{numel / 1e6:.1f}M bf16 parameters in one tensor; median of {args.rounds} rounds\n")
    print("| step | Mparam/s | ns per 16 elements | vs torch fused bf16 |")
    print("|---|---:|---:|---:|")
    for name, s in seconds.items():
        print(f"| {name} | {numel / s / 1e6:.0f} | {s / numel * 16 * 1e9:.2f} | {base / s:.2f}x |")
    if args.builds:
        for name in (name for name, library in libraries.items() if library is None):
            print(f"| {name} | n/a: it does not build here (see the message above) | | |")
    elif not args.no_instructions:
        if instructions is None:
            print("\ninstruction table: n/a (no C compiler here builds the AVX-512 loop)")
        else:
            clock, *rows = instructions.strip().splitlines()
            print(f"\nAVX-512 instructions, {_CHAINS} independent chains each, one thread; {clock}\n")
            print("| instruction (512-bit) | ns per instruction | cycles |")
            print("|---|---:|---:|")
            print("\n".join(rows))


if __name__ == "__main__":
    main()
