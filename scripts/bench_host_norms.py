"""The host sums' 2-norms one after another, as torch measures them, against side by side
(``grad_norm.host_norms``): the pass a clipped window takes over the host ring's sums.

Usage: python scripts/bench_host_norms.py [--params 500e6] [--repeats 10] [--threads N]

Llama-shaped host tensors (scripts/bench_host_step.py's shapes) in bf16 (the parameters' dtype)
and fp32 (``grad_sum_dtype: fp32``) are measured both ways, in turns, each way going first every
other repetition; both give the same bits (checked here too). torch measures one CPU tensor's norm
on one core, so "one after another" leaves the other cores idle; "side by side" runs one tensor
per thread, as many threads as torch's. Prints a markdown table naming the CPU: median seconds,
seconds per 100M parameters, GB/s read, and side by side over one after another.
"""

import argparse
import statistics
import time

import torch

from bench_host_step import threads_and_shapes
from torchtune_offload.bench.arguments import positive_int, positive_number
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.optim import grad_norm
from torchtune_offload.optim.grad_norm import host_norms, tensor_norm

WAYS = ("one after another", "side by side")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=positive_number, default=500e6, help="parameters in all (default 500e6)")
    parser.add_argument("--repeats", type=positive_int, default=10, help="timed repetitions after 1 warm-up (default 10)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's, all cores)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    dims, numel = threads_and_shapes(args)
    # Measured side by side whatever their size: this compares the two ways, not the threshold.
    grad_norm.PARALLEL_MIN_BYTES = 0
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {numel / 1e6:.1f}M "
          f"parameters in {len(dims)} Llama-shaped tensors; medians of {args.repeats} repetitions after 1 "
          "warm-up, the two ways in turns\n")
    print("| sums | way | s | s per 100M params | GB/s | side by side / one after another |")
    print("|---|---|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        sums = [torch.randn(s, generator=gen).to(dtype) for s in dims]
        ways = {WAYS[0]: lambda: [tensor_norm(g) for g in sums], WAYS[1]: lambda: host_norms(sums)}
        a, b = (way() for way in ways.values())
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            raise SystemExit("the two ways gave different bits")
        times = {way: [] for way in ways}
        for i in range(args.repeats + 1):
            for way in (WAYS if i % 2 == 0 else WAYS[::-1]):
                start = time.perf_counter()
                ways[way]()
                if i >= 1:
                    times[way].append(time.perf_counter() - start)
        med = {way: statistics.median(t) for way, t in times.items()}
        nbytes = sum(g.nbytes for g in sums)
        for way in WAYS:
            ratio = f"{med[way] / med[WAYS[0]]:.2f}" if way == WAYS[1] else ""
            print(f"| {str(dtype).removeprefix('torch.')} | {way} | {med[way]:.4f} | {med[way] / numel * 1e8:.4f} | "
                  f"{nbytes / med[way] / 1e9:.1f} | {ratio} |")
        sums = None


if __name__ == "__main__":
    main()
