"""``python -m torchtune_offload.plan --config <yaml> [key=value ...]``: will this run fit?

Prints, for the run the config describes and for each optimizer variant, the predicted peak device
memory (weights, gradients, optimizer state on the device, activations) and peak host memory, and
whether each fits the budgets (default: this machine). Nothing is downloaded or loaded: the model
is traced on fake tensors, so an 8B config plans on a laptop.
"""

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from omegaconf import OmegaConf

from torchtune_offload.bench.sweep import VARIANTS
from torchtune_offload.plan.planner import (
    GIB,
    default_device_budget,
    default_host_budget,
    default_variants,
    format_plans,
    load_config,
    plan_variant,
    process_baseline,
    sequence_length,
)

RECIPE_OF = {"full_finetune_single_device": "full", "lora_finetune_single_device": "lora",
             "full_finetune_distributed": "distributed"}


def _recipe_of(config: Path) -> str:
    """The recipe a config's header launches (``tune run recipes/<name>.py``), else by its model."""
    text = config.read_text()
    for name, recipe in RECIPE_OF.items():
        if f"recipes/{name}.py" in text:
            return recipe
    return "lora" if "lora" in str(OmegaConf.select(OmegaConf.load(config), "model._component_", default="")) else "full"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtune_offload.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, type=Path, help="a recipe config (YAML)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for tune run")
    p.add_argument("--recipe", choices=sorted(set(RECIPE_OF.values())), help="default: from the config's header")
    p.add_argument("--variants", default=",".join(default_variants()),
                   help=f"comma-separated: config (as given) and any of {', '.join(VARIANTS)}")
    p.add_argument("--device-gib", type=float, help="device memory budget (default: this machine's GPU)")
    p.add_argument("--host-gib", type=float, help="host memory budget (default: what this machine has available)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the config's)")
    p.add_argument("--json", type=Path, help="also write the plans to this JSON file")
    args = p.parse_intermixed_args(argv)
    if not args.config.is_file():
        p.error(f"--config {args.config}: no such file")
    unknown = [v for v in args.variants.split(",") if v != "config" and v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from config, {', '.join(VARIANTS)}")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        p.error(f"overrides must be key=value: {bad}")
    recipe = args.recipe or _recipe_of(args.config)
    cfg = load_config(str(args.config), args.overrides)
    device = torch.device(str(cfg.device))
    baseline, baseline_notes = process_baseline(cfg, device=device)  # before anything is traced
    device_budget = int(args.device_gib * GIB) if args.device_gib else default_device_budget(device)
    host_budget = int(args.host_gib * GIB) if args.host_gib else default_host_budget()
    if device.type == "cpu" and args.device_gib is None:
        device_budget = host_budget  # a CPU run's device memory is the host's
    plans, traces = [], {}
    for name in args.variants.split(","):
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        plan = plan_variant(str(args.config), args.overrides, name, recipe=recipe, seq_len=args.seq_len,
                            baseline=baseline, traces=traces)
        plan.notes += baseline_notes if plan.problem is None else []
        plans.append(plan)
    try:
        seq_note = f"batch {cfg.batch_size} x {sequence_length(cfg, args.seq_len)} tokens"
    except ValueError:
        seq_note = "sequence length unknown"
    print(format_plans(plans, device=str(device), device_budget=device_budget, host_budget=host_budget,
                       config_path=str(args.config), seq_len_note=seq_note))
    if args.json:
        args.json.write_text(json.dumps({"device_budget": device_budget, "host_budget": host_budget,
                                         "plans": [asdict(p) for p in plans]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
