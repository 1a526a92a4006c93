"""Host bytes per offloaded bf16 parameter: what memory_report says and what RSS shows, per engine setting.

Usage: python scripts/bench/host_memory_rss.py [--layers 24] [--width 2048] [--steps 2] [--rows TEXT]

Builds a bf16 model of ``--layers`` square bias-free linears (24 x 2048 x 2048: 100.7M parameters)
and wraps it in ``OffloadOptimizer`` with each setting of :data:`SETTINGS`: ``offload_gradients``
around ``torchtune_offload.AdamW8bit`` and around torch's AdamW (bf16 states), and
``update_on="device"`` around torch's AdamW (states alone on the host). It trains ``--steps`` steps,
drops the gradients, and prints, per setting, the host bytes per parameter that ``memory_report()``
gives next to the process's RSS growth from just before the optimizer is built to after the last
step. On a CPU-only machine ``update_on="device"`` is its exact emulation, whose "device" staging
buffers are host memory too: they are added to its report for the comparison (and printed below
the table, as the staging ring, unused without accumulation, is). Each setting runs in a fresh
process of its own, so memory that another run freed cannot blur its growth. Prints a markdown
table naming the CPU.
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

#: Row name -> the base optimizer and the engine's options.
SETTINGS = {
    "OffloadOptimizer, torchtune_offload.AdamW8bit, offload_gradients":
        ("torchtune_offload.AdamW8bit", {"offload_gradients": True}),
    "OffloadOptimizer, torch AdamW (bf16 states), offload_gradients":
        ("torch.optim.AdamW", {"offload_gradients": True}),
    "OffloadOptimizer, torch AdamW (bf16 states), update_on=device":
        ("torch.optim.AdamW", {"update_on": "device"}),
}


def probe(name: str, *, layers: int, width: int, steps: int) -> dict:
    """One setting's figures, measured in this process (run it in a fresh one)."""
    optimizer_class, options = SETTINGS[name]
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).bfloat16()
    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    opt = OffloadOptimizer(model.named_parameters(), optimizer_class, lr=1e-4, **options)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(2, width, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
    opt.synchronize()
    opt.zero_grad()  # gradients left on the device (update_on=device) are the model's, not the optimizer's
    gc.collect()
    grown = process.memory_info().rss - before
    report = opt.memory_report()
    # Host memory beside the report on this machine: the staging ring, and the emulated device's staging.
    staging = (0 if opt._staging.on_device else opt._staging.nbytes) + (
        report.device_staging_bytes if opt.device.type == "cpu" else 0)
    opt.close()
    return {"numel": sum(p.numel() for p in model.parameters()), "report": report.host_bytes, "staging": staging,
            "grown": grown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24, help="square linears (default 24)")
    parser.add_argument("--width", type=int, default=2048, help="their width (default 2048: 100.7M parameters)")
    parser.add_argument("--steps", type=int, default=2, help="training steps before measuring (default 2)")
    parser.add_argument("--rows", default="", help="only the settings whose name contains this text (default: all)")
    parser.add_argument("--probe", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key in ("layers", "width", "steps"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be at least 1")
    if args.probe:
        print(json.dumps(probe(args.probe, layers=args.layers, width=args.width, steps=args.steps)))
        return
    rows = {}
    for name in SETTINGS:
        if args.rows not in name:
            continue
        cmd = [sys.executable, __file__, "--probe", name, "--layers", str(args.layers),
               "--width", str(args.width), "--steps", str(args.steps)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    if not rows:
        parser.error(f"--rows {args.rows!r} matches no setting; choose from {list(SETTINGS)}")
    numel = next(iter(rows.values()))["numel"]
    print(f"{cpu_name()}, torch {torch.__version__}; {numel / 1e6:.1f}M bf16 parameters in {args.layers} "
          f"linears of {args.width} x {args.width}, {args.steps} steps; RSS growth from before the optimizer is "
          "built to after the last step (gradients dropped), each setting in a fresh process; the report "
          "column adds the host memory beside memory_report listed below the table\n")
    print("| setting | memory_report B/param | RSS growth B/param | RSS growth / report |")
    print("|---|---:|---:|---:|")
    for name, r in rows.items():
        held = r["report"] + r["staging"]
        print(f"| {name} | {r['report'] / r['numel']:.3f} | {r['grown'] / r['numel']:.3f} | {r['grown'] / held:.3f} |")
    for name, r in rows.items():
        print(f"\n{name}: memory_report {r['report']} bytes (beside it: staging {r['staging']}), "
              f"RSS growth {r['grown']} bytes", end="")
    print()


if __name__ == "__main__":
    main()
