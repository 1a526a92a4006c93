"""Host bytes per offloaded bf16 parameter with offload_gradients: what memory_report says and what RSS shows.

Usage: python scripts/host_memory_8bit.py [--layers 24] [--width 2048] [--steps 2]

Builds a bf16 model of ``--layers`` square bias-free linears (24 x 2048 x 2048: 100.7M parameters),
wraps it in ``OffloadOptimizer(..., offload_gradients=True)`` around ``torchtune_offload.AdamW8bit``
and, for comparison, around torch's AdamW (bf16 states), trains ``--steps`` steps and prints, per
optimizer, the host bytes per parameter that ``memory_report()`` gives (its staging ring, unused
without accumulation, is printed below the table) next to the process's RSS growth from just before the optimizer is built to after the last step. Each
optimizer runs in a fresh process of its own, so memory that another run freed cannot blur its
growth. Prints a markdown table naming the CPU.
"""

import argparse
import gc
import json
import subprocess
import sys

import psutil
import torch
from torch import nn

from torchtune_offload import OffloadOptimizer
from torchtune_offload.bench.machine import cpu_name

OPTIMIZERS = {
    "torchtune_offload.AdamW8bit": "OffloadOptimizer, torchtune_offload.AdamW8bit, offload_gradients",
    "torch.optim.AdamW": "OffloadOptimizer, torch AdamW (bf16 states), offload_gradients",
}


def probe(optimizer_class: str, *, layers: int, width: int, steps: int) -> dict:
    """One optimizer's figures, measured in this process (run it in a fresh one)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).bfloat16()
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, offload_gradients=True, lr=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, width, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    opt.synchronize()
    gc.collect()
    grown = process.memory_info().rss - before
    report = opt.memory_report()
    staging = opt._staging.nbytes
    opt.close()
    return {"numel": sum(p.numel() for p in model.parameters()), "report": report.host_bytes, "staging": staging,
            "grown": grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="square linears (default 24)")
    parser.add_argument("--width", type=int, default=2048, help="their width (default 2048: 100.7M parameters)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before measuring (default 2)")
    parser.add_argument("--probe", choices=list(OPTIMIZERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key in ("layers", "width", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be at least 1")
    if args.probe:
        print(json.dumps(probe(args.probe, layers=args.layers, width=args.width, steps=args.steps)))
        return
    rows = {}
    for optimizer_class in OPTIMIZERS:
        cmd = [sys.executable, __file__, "--probe", optimizer_class, "--layers", str(args.layers),
               "--width", str(args.width), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[optimizer_class] = json.loads(out.stdout.strip().splitlines()[-1])
    numel = rows["torchtune_offload.AdamW8bit"]["numel"]
    print(f"{cpu_name()}, torch {torch.__version__}; {numel / 1e6:.1f}M bf16 parameters in {args.layers} "
          f"linears of {args.width} x {args.width}, offload_gradients=True, {args.steps} steps; RSS growth from "
          "before the optimizer is built to after the last step, each optimizer in a fresh process\n")
    print("| optimizer | memory_report B/param | RSS growth B/param | RSS growth / memory_report |")
    print("|---|---:|---:|---:|")
    for optimizer_class, name in OPTIMIZERS.items():
        r = rows[optimizer_class]
        print(f"| {name} | {r['report'] / r['numel']:.3f} | {r['grown'] / r['numel']:.3f} | "
              f"{r['grown'] / r['report']:.3f} |")
    for optimizer_class, r in rows.items():
        print(f"\n{optimizer_class}: memory_report {r['report']} bytes (staging ring {r['staging']}), "
              f"RSS growth {r['grown']} bytes", end="")
    print()


if __name__ == "__main__":
    main()
