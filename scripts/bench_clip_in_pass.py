"""Clipping in the host pass against clipping before it: the host step of a clipped window, side by side.

Usage: python scripts/bench_clip_in_pass.py [--params 100e6] [--steps 20] [--threads N]

For each host pass that takes the clipping factor (this project's AdamW8bit pass, and the fused
fp32-master pass), two engines over the same Llama-shaped bf16 tensors (scripts/bench_host_step.py's)
step in turns with an unclipped one, one step each, the three taking turns to go first: "before"
scales every host gradient in place (``grad.mul_(factor)``, torch's CPU multiply) and then steps,
as the overlapped engine did; "after" hands the factor to the pass, which multiplies as it reads
the gradient. The results are the same bits (tests/optim/test_grad_scale.py); what differs is one
read and one write of every bf16 gradient (4 bytes a parameter) against the pass's own; the
unclipped step is the floor.
Prints a markdown table naming the CPU: median seconds of each, after over before, and after over
unclipped.
"""

import argparse
import statistics
import time

import torch

from bench_host_step import CLIP_FACTOR, engine, threads_and_shapes
from torchtune_offload.bench.arguments import positive_int, positive_number
from torchtune_offload.bench.machine import cpu_name

#: The passes that take the factor: (row name, engine options).
PASSES = [
    ("AdamW8bit states (C pass)", {"optimizer_class": "torchtune_offload.AdamW8bit"}),
    ("fp32 master, fused pass", {"master_dtype": "fp32"}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=positive_number, default=100e6, help="parameters to step (default 100e6)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps of each kind, after 2 warm-up (default 20, "
                        "at least 10)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.steps < 10:
        parser.error("--steps must be at least 10")
    dims, numel = threads_and_shapes(args)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; {numel / 1e6:.1f}M bf16 "
          f"parameters in {len(dims)} Llama-shaped tensors; clipping factor {float(CLIP_FACTOR)}; medians of "
          f"{args.steps} steps, the three kinds in turns\n")
    print("| host pass | unclipped, s | clipped before: scale, then step, s | clipped after: factor in the pass, s "
          "| after / before | after / unclipped |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, options in PASSES:
        kinds = {kind: engine(dims, torch.bfloat16, clip=clip, **options)
                 for kind, clip in (("unclipped", None), ("before", "mul"), ("after", "pass"))}
        order = list(kinds)
        times = {kind: [] for kind in kinds}
        for i in range(args.steps + 2):
            turn = order[i % 3:] + order[:i % 3]  # each kind goes first in turn
            for kind in turn:
                start = time.perf_counter()
                kinds[kind]()
                if i >= 2:
                    times[kind].append(time.perf_counter() - start)
        med = {kind: statistics.median(t) for kind, t in times.items()}
        print(f"| {name} | {med['unclipped']:.4f} | {med['before']:.4f} | {med['after']:.4f} | "
              f"{med['after'] / med['before']:.2f} | {med['after'] / med['unclipped']:.2f} |")
        kinds = None


if __name__ == "__main__":
    main()
