"""Runs one config with each optimizer variant and prints tok/s and memory side by side.

Usage:
    python scripts/benchmark_sweep.py --config configs/llama3_2/1B_full_paged_adamw.yaml --steps 20 \
        [--variants adamw,paged_adamw,paged_adamw8bit,torchao,offload,offload_grads] \
        [--output-dir outputs/sweep] [-- key=value ...]

Each variant is a real `tune run` of recipes/full_finetune_single_device.py with the optimizer
swapped on the command line; everything after `--` is passed to every run (e.g. a random-init
checkpoint: `checkpointer.checkpoint_dir=/tmp/llama3_2_1b_random`). Steps: `max_steps_per_epoch`,
one epoch; the table's tok/s is the median over steps after the first (warm-up). Variants that
cannot run on this machine (torchao without CUDA/XPU) are reported as skipped.
"""

import argparse
import os
import subprocess
import sys

import torch
from omegaconf import OmegaConf

from torchtune_offload.recipe.run_report import compare_runs

# Per variant: the optimizer keys it sets, and other overrides it needs.
VARIANTS = {
    "adamw": ({"_component_": "torch.optim.AdamW"}, []),
    "paged_adamw": ({"_component_": "bitsandbytes.optim.PagedAdamW"}, []),
    "paged_adamw8bit": ({"_component_": "bitsandbytes.optim.PagedAdamW8bit"}, []),
    # torchao cannot clip; the recipe refuses clip_grad_norm with it.
    "torchao": ({"_component_": "torchtune_offload.CPUOffloadOptimizer", "optimizer_class": "torch.optim.AdamW"},
                ["clip_grad_norm=null"]),
    "offload": ({"_component_": "torchtune_offload.OffloadOptimizer", "optimizer_class": "torch.optim.AdamW"}, []),
    "offload_grads": ({"_component_": "torchtune_offload.OffloadOptimizer", "optimizer_class": "torch.optim.AdamW",
                       "offload_gradients": True}, []),
}
OFFLOAD_ONLY_KEYS = ("optimizer_class", "offload_gradients", "minimal_size")
OPTIONS = {
    "--config": dict(required=True, help="a full fine-tune config"),
    "--steps": dict(type=int, default=20, help="optimizer steps per run (>= 11: 10 measured after warm-up)"),
    "--variants": dict(default="adamw,paged_adamw,paged_adamw8bit,torchao,offload,offload_grads"),
    "--output-dir": dict(default="outputs/sweep"),
}


def _overrides(config: str, name: str) -> list:
    """Command-line overrides that turn ``config``'s optimizer into variant ``name``."""
    keys, others = VARIANTS[name]
    present = OmegaConf.load(config).optimizer
    # Offload-only keys the variant does not set are deleted (plain optimizers reject them).
    drop = [f"~optimizer.{k}" for k in OFFLOAD_ONLY_KEYS if k in present and k not in keys]
    return drop + [f"optimizer.{k}={v}" for k, v in keys.items()] + others


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kw in OPTIONS.items():
        parser.add_argument(flag, **kw)
    args = parser.parse_args(argv)
    if args.steps < 11:
        parser.error("--steps must be at least 11 (one warm-up step, then at least 10 measured)")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")

    has_accel = torch.accelerator.is_available()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    done = []
    for name in names:
        if name == "torchao" and not has_accel:
            print(f"[sweep] {name}: skipped (torchao's optimizer needs CUDA or XPU)")
            continue
        out = os.path.join(args.output_dir, name)
        overrides = _overrides(args.config, name)
        cmd = ["tune", "run", "recipes/full_finetune_single_device.py", "--config", args.config,
               *overrides, f"max_steps_per_epoch={args.steps}", "epochs=1", f"output_dir={out}",
               "log_peak_memory_stats=True", "log_every_n_steps=1", *extra]
        print("[sweep] " + " ".join(cmd), flush=True)
        result = subprocess.run(cmd)
        if result.returncode != 0:
            print(f"[sweep] {name}: failed with exit code {result.returncode}")
            continue
        done.append((name, out))
    print(f"\nDevice: {device}; config {args.config}; {args.steps} steps per run")
    if done:
        print(compare_runs(dict(done)))


if __name__ == "__main__":
    main()
