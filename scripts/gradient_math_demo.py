"""What the optimizer steps on: torchtune's own recipe with torchao's offload optimizer, against ours.

Runs the tiny model with gradient accumulation and clipping three times and prints, per step, the
global norm of the gradients the (host) AdamW stepped on, recorded by
``torchtune_offload.bench.grad_probe.GradNormProbeAdamW``, and the logged losses:

- ``plain``: torchtune 0.6.1's ``full_finetune_single_device`` recipe with plain AdamW on the device;
- ``torchao``: the same torchtune recipe with torchao's ``CPUOffloadOptimizer`` (CUDA/XPU only);
- ``ours``: this project's recipe with ``OffloadOptimizer``.

Usage (from the repository root, tiny assets built): ``python scripts/gradient_math_demo.py
[--device cuda] [--output-dir outputs/grad_math] [-- key=value ...]``
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import torch

from torchtune_offload.bench.grad_probe import ENV, read_probe
from torchtune_offload.recipe.reports.disk_log import read_disk_log

PROBE = "torchtune_offload.bench.grad_probe.GradNormProbeAdamW"
SETTINGS = ["gradient_accumulation_steps=4", "clip_grad_norm=1.0", "max_steps_per_epoch=6", "epochs=1",
            "batch_size=8", "dtype=fp32", "log_every_n_steps=1", "seed=0", "overwrite_checkpoints=True"]
RUNS = {
    # name: (recipe for `tune run`, optimizer overrides)
    "plain": ("full_finetune_single_device", [f"optimizer._component_={PROBE}"]),
    "torchao": ("full_finetune_single_device", ["optimizer._component_=torchtune_offload.CPUOffloadOptimizer",
                                                f"optimizer.optimizer_class={PROBE}"]),
    "ours": ("recipes/full_finetune_single_device.py", ["optimizer._component_=torchtune_offload.OffloadOptimizer",
                                                       f"optimizer.optimizer_class={PROBE}"]),
}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output-dir", default="outputs/grad_math", type=Path)
    args = parser.parse_args(argv)
    names = [n for n in RUNS if n != "torchao" or args.device != "cpu"]
    if "torchao" not in names:
        print("torchao's optimizer needs CUDA or XPU: its run is skipped on the CPU")
    norms, losses = {}, {}
    for name in names:
        recipe, optimizer = RUNS[name]
        out = args.output_dir / name
        out.mkdir(parents=True, exist_ok=True)
        probe = out / "grad_norms.jsonl"
        probe.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", recipe, "--config", "configs/tiny/full.yaml",
               *optimizer, *SETTINGS, f"device={args.device}", f"output_dir={out}", *extra]
        print("$ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env={**os.environ, ENV: str(probe)})
        norms[name] = read_probe(probe)
        losses[name] = [row["loss"] for row in read_disk_log(out)]
    print(f"\nGlobal norm of the gradients AdamW stepped on (device {args.device}; "
          f"{' '.join(SETTINGS)}), and the logged loss")
    print("step  " + "  ".join(f"{n + ' norm':>14}  {n + ' loss':>12}" for n in names))
    for i, step in enumerate(norms["plain"]):
        print(f"{step:>4}  " + "  ".join(f"{norms[n].get(step, float('nan')):>14.6g}  {losses[n][i]:>12.6f}"
                                        for n in names))


if __name__ == "__main__":
    main()
