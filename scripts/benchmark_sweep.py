"""Runs one config with each optimizer variant and tabulates tok/s, memory and loss side by side.

Usage:
    python scripts/benchmark_sweep.py --config configs/llama3_2/1B_full_paged_adamw.yaml --steps 20 \
        [--variants adamw,paged_adamw,...] [--gpu-memory-gib 24] [--output-dir outputs/sweep] \
        [--timeout-s 600] [--wandb PROJECT [--wandb-group NAME]] [--force] [-- key=value ...]

Each variant is a real `tune run` of recipes/full_finetune_single_device.py with the optimizer swapped
on the command line; everything after `--` goes to every run (e.g. a random-init checkpoint and
synthetic data, see docs/gpu_results.md). One epoch of `--steps` steps; tok/s is the median over the
steps after the first (warm-up). `--gpu-memory-gib N` leaves only N GiB of the GPU free, held by a
ballast process, so bitsandbytes' unified memory is limited as on a smaller card. Writes
results.md, results.json and results.png (tok/s against peak memory, and the loss curves; needs
matplotlib) under the output directory, and each variant's log to <variant>/run.log. With --wandb,
each variant becomes one W&B run in one group, its steps and peaks included, its resolved config in
`recipe_config` (WANDB_MODE=offline keeps them on disk, in <output-dir>/wandb unless WANDB_DIR is
set; online, an API key is checked for first).
An output directory that holds an earlier sweep's results is refused unless --force, which
replaces them. A problem of the config or of the overrides after `--` that every
variant's config check refuses (a misspelt key, a missing checkpoint) stops the sweep before it runs.
"""

import argparse
import contextlib
import importlib.util
import math
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune_offload.bench.ballast import GpuBallast
from torchtune_offload.bench.sweep import (
    device_name,
    log_to_wandb,
    run_variant,
    variant_overrides,
    write_plot,
    write_results,
)
from torchtune_offload.bench.variants import SINGLE_DEVICE_VARIANTS, VARIANTS
from torchtune_offload.plan.planner import load_config
from torchtune_offload.recipe import RECIPE_KINDS, preflight

OPTIONS = {
    "--config": dict(required=True, help="a full fine-tune config"),
    "--steps": dict(type=int, default=20, help="optimizer steps per run (>= 11: 10 measured after warm-up)"),
    "--variants": dict(default=",".join(SINGLE_DEVICE_VARIANTS),
                       help=f"comma-separated, from {', '.join(VARIANTS)} (default: all but the fsdp2_ ones)"),
    "--nproc-per-node": dict(type=int, default=2, help="ranks of the fsdp2_ variants (the distributed recipe)"),
    "--output-dir": dict(default="outputs/sweep"),
    "--gpu-memory-gib": dict(type=float, default=None,
                             help="leave only this much GPU memory free (ballast in another process)"),
    "--timeout-s": dict(type=float, default=None, help="stop a variant after this many seconds (> 0)"),
    "--wandb": dict(default=None, metavar="PROJECT", help="log each variant as a W&B run of this project"),
    "--wandb-group": dict(default=None, help="the runs' W&B group (default: the output directory's name)"),
    "--force": dict(action="store_true",
                    help="replace the results of an earlier sweep in --output-dir (refused without it)"),
}


def main() -> None:
    args, names, extra = _parse_args(sys.argv[1:])
    device = device_name()
    output_dir = Path(args.output_dir)
    results = []
    limited = args.gpu_memory_gib is not None
    ballast = GpuBallast(leave_gib=args.gpu_memory_gib) if limited else contextlib.nullcontext()
    with ballast:
        limit = f"; {ballast.report}" if limited else "; whole device"
        print(f"[sweep] {device}{limit}", flush=True)
        for i, name in enumerate(names, 1):
            print(f"[sweep] {i}/{len(names)} {name}: running (log {output_dir / name / 'run.log'})", flush=True)
            replaced = VARIANTS[name].replaced(extra)
            if replaced:
                print(f"[sweep] {name} runs with {' '.join(VARIANTS[name].needs)} in place of {' '.join(replaced)} "
                      "(what its optimizer needs)", flush=True)
            r = run_variant(name=name, config=args.config, steps=args.steps, output_dir=output_dir,
                            extra=extra, timeout_s=args.timeout_s, nproc_per_node=args.nproc_per_node)
            tps = f", {r.tokens_per_second:.0f} tok/s" if r.tokens_per_second else ""
            short = r.status == "ok" and r.steps < r.steps_requested  # one epoch of the data ended first
            short = f", {r.steps} of {r.steps_requested} steps (the data ran out)" if short else ""
            print(f"[sweep] {i}/{len(names)} {name}: {r.status} in {r.seconds:.0f} s{tps}{short}", flush=True)
            results.append(r)
            write_results(results, output_dir=output_dir, header=_header(device, limit, args, extra))
    header = _header(device, limit, args, extra)
    md = write_results(results, output_dir=output_dir, header=header)
    print(md.read_text())
    if any(r.steps for r in results):
        print(f"[sweep] each step's loss, side by side: tune-offload compare {output_dir}")
    try:
        print(f"[sweep] plot: {write_plot(results, path=output_dir / 'results.png', title=header)}")
    except ImportError:
        print("[sweep] no plot: matplotlib is not installed (pip install 'torchtune-offload[bench]')")
    if args.wandb:
        group = args.wandb_group or output_dir.resolve().name
        recipe_configs = {n: OmegaConf.to_container(_variant_config(args, n, extra), resolve=True) for n in names}
        runs = log_to_wandb(results, project=args.wandb, group=group, recipe_configs=recipe_configs,
                            directory=output_dir,
                            config={"config": args.config, "steps": args.steps, "device": device,
                                    "gpu_memory_gib": args.gpu_memory_gib, "overrides": " ".join(extra)})
        files = Path(os.environ.get("WANDB_DIR") or output_dir) / "wandb"
        print(f"[sweep] W&B project {args.wandb}, group {group}: {len(runs)} runs (W&B's files: {files})")


def _parse_args(argv: list) -> tuple[argparse.Namespace, list, list]:
    """The sweep's options, its variant names and the overrides after ``--``, each checked before any
    variant runs (a refusal exits through ``parser.error``)."""
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, kw in OPTIONS.items():
        parser.add_argument(flag, **kw)
    args = parser.parse_args(argv)
    if args.nproc_per_node < 1:
        parser.error("--nproc-per-node must be at least 1")
    if args.steps < 11:
        parser.error("--steps must be at least 11 (one warm-up step, then at least 10 measured)")
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:  # a second run would replace the first's folder and log
        parser.error(f"--variants names {', '.join(twice)} more than once: name each variant once")
    if not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file (give the path of a full fine-tune config)")
    if args.timeout_s is not None and not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        parser.error(f"--timeout-s {args.timeout_s}: must be a positive number of seconds (or left out)")
    problem = _output_dir_problem(Path(args.output_dir), names, force=args.force)
    if problem:
        parser.error(problem)
    if args.gpu_memory_gib is not None and not torch.cuda.is_available():
        parser.error("--gpu-memory-gib needs a CUDA device")
    if args.wandb:
        problem = _wandb_problem()
        if problem:
            parser.error(problem)
    # A shared override of a key the sweep or a variant sets would run every variant under one label's name.
    # What a variant needs (torchtune's in-backward setting: no clipping, no accumulation) wins over
    # the shared overrides for that variant alone, as the planner plans it: said below, not refused.
    owned = {o.split("=", 1)[0].lstrip("~+") for n in names
             for o in variant_overrides(name=n, config=args.config, steps=args.steps, output_dir=Path("."), extra=[])
             if o not in VARIANTS[n].needs}
    owned.add("metric_logger._component_")  # the sweep reads each variant's DiskLogger file
    # A key that is part of some variant's choice (optimizer_in_bwd) would change every variant's optimizer.
    owned |= {s.split("=", 1)[0] for variant in VARIANTS.values() for s in variant.settings}
    taken = [o for o in extra if o.split("=", 1)[0].lstrip("~+") in owned]
    if taken:
        parser.error(f"overrides after -- set keys the sweep or a variant sets: {' '.join(taken)}. "
                     "Choose variants with --variants, the step count with --steps and W&B with --wandb instead.")
    problem = _shared_config_problem(args, names, extra)
    if problem:
        parser.error(f"every variant's config check refuses the config with these overrides:\n{problem}")
    return args, names, extra


def _wandb_problem() -> str:
    """Why the runs could not be logged to W&B at the sweep's end, found before any variant runs: wandb
    is missing, or W&B would go online without an API key (``wandb.init`` would then fail, or ask
    for one, after the last variant)."""
    if importlib.util.find_spec("wandb") is None:
        return "--wandb needs wandb, an optional dependency: pip install 'torchtune-offload[wandb]'"
    import wandb  # optional dependency

    try:
        if wandb.setup().settings.mode in ("offline", "dryrun", "disabled"):
            return ""
        if not wandb.login(prompt=False, verify=False):
            return ("--wandb: W&B has no API key here. Run `wandb login` (or set WANDB_API_KEY), or set "
                    "WANDB_MODE=offline to keep the runs on disk and `wandb sync` them later")
        return ""
    except ValueError as err:  # W&B's settings refuse a value (WANDB_MODE=onlin, say)
        return f"--wandb: W&B refuses its settings: {' '.join(str(err).split())[:300]}"
    finally:
        # wandb.setup() starts W&B's service process and names it in WANDB_SERVICE, which every
        # variant's environment would inherit: the sweep needs neither until its end.
        wandb.teardown()


def _variant_config(args: argparse.Namespace, name: str, extra: list) -> DictConfig:
    """The config variant ``name`` runs, as its ``tune run`` merges it."""
    return load_config(args.config, variant_overrides(name=name, config=args.config, steps=args.steps,
                                                      output_dir=Path(args.output_dir), extra=extra))


def _shared_config_problem(args: argparse.Namespace, names: list, extra: list) -> str:
    """The first variant's refusal, when each variant's config check (as the recipe makes it, before
    it loads anything) refuses: then the problem is the config's or the shared overrides', and each
    variant would start a process only to fail on it. Empty when a variant passes (a refusal of some
    variants only is theirs: the sweep reports it and goes on). The device is not checked: that would
    start CUDA here, and this process should hold no GPU memory while the variants run."""
    first = ""
    for name in names:
        try:  # torchtune's merge refuses an override that is not key=value with a ValueError too
            preflight(_variant_config(args, name, extra), recipe=RECIPE_KINDS[VARIANTS[name].recipe],
                      device_present=False)
        except ValueError as err:
            first = first or str(err)
            continue
        return ""
    return first


def _output_dir_problem(output_dir: Path, names: list, *, force: bool) -> str:
    """Why the sweep may not write to ``output_dir``, or "": an earlier sweep's results there would
    be replaced by this one's (which may run other variants), unless ``--force``."""
    if output_dir.exists() and not output_dir.is_dir():
        return f"--output-dir {output_dir}: is a file; give a folder (it is made if missing)"
    earlier = [p for p in (output_dir / "results.json", *(output_dir / n / "run.log" for n in names)) if p.exists()]
    if earlier and not force:
        return (f"--output-dir {output_dir}: holds an earlier sweep's results ({', '.join(map(str, earlier[:3]))}"
                f"{', ...' if len(earlier) > 3 else ''}), which this sweep would replace. Give another --output-dir, "
                "or --force to replace them")
    return ""


def _header(device: str, limit: str, args: argparse.Namespace, extra: list) -> str:
    # Without CUDA, bitsandbytes keeps the paged optimizers' states in ordinary memory: nothing pages.
    paged = device == "CPU" and any(n.startswith("paged_") for n in args.variants.split(","))
    return (f"Device: {device}{limit}. Config {args.config}, {args.steps} steps per variant, "
            f"overrides: `{' '.join(extra) or 'none'}`. Memory in GiB."
            + (" On the CPU the paged_* variants page nothing (no CUDA unified memory)." if paged else ""))


if __name__ == "__main__":
    main()
