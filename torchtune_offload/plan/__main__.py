"""``python -m torchtune_offload.plan --config <yaml or name> [key=value ...]``: will this run fit?

Prints, for the run the config describes and for each optimizer variant, the predicted peak device
memory (weights, gradients, optimizer state on the device, activations) and peak host memory, and
whether each fits the budgets (default: this machine). Then the same for the full, LoRA and QLoRA
fine-tunes of the configured model (torchtune's ``<name>``, ``lora_<name>`` and ``qlora_<name>``
builders), each with the configured optimizer: which of them fits. Nothing is downloaded or
loaded: the model is traced on fake tensors, so an 8B config plans on a laptop. A model the
planner cannot build or trace ends the plan with one line naming ``model._component_`` (exit 2); a
config with a problem no variant's optimizer settings change (a misspelt key, a component's option)
is refused before anything is planned (exit 1); a variant the recipe refuses gets the reason in its
row, the other rows as planned, and exit 1.
With ``--machine`` (a preset or a ``tune-offload probe`` file), each variant's row also gets its
predicted seconds per step, tok/s and bound (:mod:`torchtune_offload.plan.speed`).
A config of the distributed recipe is planned per rank over ``--nproc-per-node`` ranks on one machine
(default 1, as ``tune run`` starts one): each device's peak and the machine's host memory, for the
config and the ``fsdp2_`` variants (:mod:`torchtune_offload.plan.fsdp`).
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from torchtune_offload.bench.arguments import check_output_file
from torchtune_offload.bench.variants import DISTRIBUTED_VARIANTS, SINGLE_DEVICE_VARIANTS, VARIANTS
from torchtune_offload.plan.fastest import fastest_fitting, math_change
from torchtune_offload.plan.planner import (
    GIB,
    VariantPlan,
    default_device_budget,
    default_host_budget,
    load_config,
    plan_fine_tunes,
    plan_speed,
    plan_variant,
    process_baseline,
    step_requests,
    variant_config,
)
from torchtune_offload.plan.report import format_fine_tunes, format_plans
from torchtune_offload.plan.speed import DEVICE_MEMORY_KEY, Machine, load_machine, preset_names
from torchtune_offload.plan.step_traces import default_jobs, sequence_length, trace_steps
from torchtune_offload.plan.trace import UntraceableModelError, check_builder_imports
from torchtune_offload.recipe.checks.component_options import component_removal_problem
from torchtune_offload.recipe.checks.config import config_shape_problems
from torchtune_offload.recipe.chosen_optimizer import describe_optimizer
from torchtune_offload.recipe.shipped import RECIPE_KINDS, Shipped, header_recipe, shipped_root

def _config_path(name: str) -> Path:
    """The YAML file ``--config`` names: a path, else a shipped config's name (``tune-offload ls``).

    Raises:
        ValueError: naming what was looked for, the closest names and the configs there are.
    """
    if Path(name).is_file():
        return Path(name)
    try:
        return Shipped(shipped_root()).config(name)
    except FileNotFoundError as err:  # neither an installed copy nor a clone: only paths can be planned
        raise ValueError(f"no such file, and no shipped configs to look it up in: {err}") from err


def _recipe_of(config: Path) -> str:
    """The recipe a config's header names (as ``tune-offload`` reads it), else one by its model."""
    named = header_recipe(config, list(RECIPE_KINDS))
    if named is not None:
        return RECIPE_KINDS[named]
    return "lora" if "lora" in str(OmegaConf.select(OmegaConf.load(config), "model._component_", default="")) else "full"


def main(argv: Optional[List[str]] = None, *, prog: str = "python -m torchtune_offload.plan") -> int:
    """Plans the run a config describes; ``tune-offload plan`` calls it too.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.
        prog: the command's name, for its usage and error lines.

    Returns:
        The exit status: 0 when the config as given was planned (other variants may be refused in
        their rows), 1 when the recipe refuses the config itself, 2 for bad arguments or a model
        the planner cannot build or trace.
    """
    p = _parser(prog)
    args, machine = _checked_args(p, argv)
    recipe = args.recipe
    cfg = _load_config(p, args)
    # Before anything is traced: a builder that cannot be imported ends the plan (exit 2), as below, and
    # what no variant's optimizer settings change (a misspelt key) refuses every variant alike (exit 1).
    try:
        check_builder_imports(cfg)
    except UntraceableModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    shape = config_shape_problems(cfg, recipe=recipe)
    try:  # every variant traces this many tokens a sample: unknown, each row would say so
        seq_len = sequence_length(cfg, args.seq_len)
    except ValueError as err:
        shape.append(str(err))
    if shape:
        print(f"error: {args.config} is refused for every variant, so none was planned:\n  - " + "\n  - ".join(shape),
              file=sys.stderr)
        return 1
    device = torch.device(str(cfg.device))
    baseline, baseline_notes = process_baseline(cfg, device=device)  # before anything is traced
    budgets = _Budgets.of(args, device=device, machine=machine)
    try:
        plans, fine = _plan_all(args, recipe=recipe, baseline=baseline, baseline_notes=baseline_notes)
    except UntraceableModelError as err:
        # One line, no traceback: the model is the user's to change, not a bug to debug here.
        print(f"error: {err}", file=sys.stderr)
        return 2
    _report(args, cfg, plans, fine, machine=machine, budgets=budgets, device=device, seq_len=seq_len)
    refused = next((p.problem for p in plans if p.name == "config" and p.problem is not None), None)
    if refused is not None:
        # The table is printed for the variants; a script must still see that the config itself was refused.
        print(f"error: the config as given is refused: {refused}", file=sys.stderr)
        return 1
    return 0


def _parser(prog: str) -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--config",
                   help="a recipe config: a YAML file, or a shipped config's name (tiny/full; tune-offload ls lists "
                        "them); may also be given as the first argument, as validate and cat take it")
    p.add_argument("overrides", nargs="*", help="key=value overrides, as for tune run")
    p.add_argument("--recipe", choices=sorted(set(RECIPE_KINDS.values())), help="default: from the config's header")
    p.add_argument("--variants", help=f"comma-separated: config (as given) and any of {', '.join(SINGLE_DEVICE_VARIANTS)}"
                   f" (default: all); for the distributed recipe any of {', '.join(DISTRIBUTED_VARIANTS)}")
    p.add_argument("--nproc-per-node", type=int, help="the distributed recipe's ranks on this machine, as tune run's "
                   "--nproc_per_node (default 1): the plan is one rank's device and the machine's host")
    p.add_argument("--device-gib", type=float, help="device memory budget (default: the --machine file's or "
                   "preset's device_memory_gib, else this machine's GPU)")
    p.add_argument("--host-gib", type=float, help="host memory budget (default: what this machine has available)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: the config's)")
    p.add_argument("--fine-tunes", action=argparse.BooleanOptionalAction, default=True,
                   help="also plan the full, LoRA and QLoRA fine-tunes of the model (single-device recipes)")
    p.add_argument("--json", type=Path, help="also write the plans to this JSON file (a new one, unless --force)")
    p.add_argument("--force", action="store_true", help="let --json replace an existing file")
    p.add_argument("--jobs", type=int, default=default_jobs(),
                   help="processes that trace the plan's distinct training steps side by side (default: this "
                        "machine's cores; 1 traces each step in this process as it is needed)")
    p.add_argument("--machine", help="predict each variant's speed on this machine: a preset "
                   f"({', '.join(preset_names())}) or a machine.json (tune-offload probe --output machine.json)")
    return p


def _check_variants(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--variants`` and ``--nproc-per-node`` checked against the config's recipe (a bad one exits
    through ``p.error``); the defaults filled in: every variant of the recipe, one rank."""
    distributed = args.recipe == "distributed"
    if args.nproc_per_node is not None and not distributed:
        p.error(f"--nproc-per-node {args.nproc_per_node}: plans the distributed recipe per rank, and {args.config} runs "
                f"the {args.recipe} recipe: give a config of recipes/full_finetune_distributed.py "
                "(llama3_1/8B_full_distributed_offload, tiny/full_distributed; tune-offload ls), or --recipe distributed")
    if distributed and args.nproc_per_node is None:
        args.nproc_per_node = 1  # as tune run starts it without --nproc_per_node
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        p.error(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    mine = DISTRIBUTED_VARIANTS if distributed else SINGLE_DEVICE_VARIANTS
    if args.variants is None:
        args.variants = ",".join(["config", *mine])
    unknown = [v for v in args.variants.split(",") if v != "config" and v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; choose from config, {', '.join(mine)}")
    other = [v for v in args.variants.split(",") if v in VARIANTS and v not in mine]
    if other and distributed:
        p.error(f"--variants: {', '.join(other)} run the single-device recipe, and {args.config} the distributed one: "
                f"choose from config, {', '.join(mine)}")
    if other:
        p.error(f"--variants: {', '.join(other)} run FSDP2 over several ranks: the planner plans them per rank for a "
                "config of the distributed recipe (tiny/full_distributed, llama3_1/8B_full_distributed_offload) with "
                "--nproc-per-node N; the sweep runs them (scripts/benchmark_sweep.py --nproc-per-node N)")


def _checked_args(p: argparse.ArgumentParser,
                  argv: Optional[List[str]]) -> Tuple[argparse.Namespace, Optional[Machine]]:
    """The parsed arguments, each checked (a bad one exits through ``p.error``), and the machine
    ``--machine`` names."""
    args = p.parse_intermixed_args(argv)
    if args.config is None:
        # `plan tiny/full key=value`: the first argument that is no key=value or ~key is the config.
        if args.overrides and "=" not in args.overrides[0] and not args.overrides[0].startswith("~"):
            args.config = args.overrides.pop(0)
        else:
            p.error("the config is required: --config <yaml or name> (or as the first argument)")
    try:
        args.config = _config_path(args.config)
    except ValueError as err:
        p.error(f"--config {args.config}: {err}")
    args.recipe = args.recipe or _recipe_of(args.config)
    _check_variants(p, args)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: must be at least 1")
    for flag, gib in (("--device-gib", args.device_gib), ("--host-gib", args.host_gib)):
        if gib is not None and not (math.isfinite(gib) and gib > 0):
            p.error(f"{flag} {gib}: must be a positive number of GiB (leave it out for this machine's)")
    if args.seq_len is not None and args.seq_len < 1:
        p.error(f"--seq-len {args.seq_len}: must be at least 1 (leave it out for the config's)")
    if args.json is not None:
        check_output_file(p, args.json, flag="--json", force=args.force)
    # As for tune run: key=value sets, ~key deletes.
    bad = [o for o in args.overrides if "=" not in o and not (o.startswith("~") and len(o) > 1)]
    if bad:
        p.error(f"overrides must be key=value (or ~key to delete a key): {bad}")
    machine = None
    if args.machine is not None:
        try:
            machine = load_machine(args.machine)
        except ValueError as err:
            p.error(str(err))
    return args, machine


@dataclass(frozen=True)
class _Budgets:
    """The device and host memory the plan is read against, and where each came from when the
    reader might not expect it (empty otherwise)."""

    device: int
    host: int
    device_note: str
    host_note: str

    @classmethod
    def of(cls, args: argparse.Namespace, *, device: torch.device, machine: Optional[Machine]) -> "_Budgets":
        """The budgets the flags give, else the machine file's device memory, else this machine's."""
        host_budget = int(args.host_gib * GIB) if args.host_gib is not None else default_host_budget()
        # Said: a plan for a --machine preset is otherwise read against another machine's host memory.
        host_note = "" if args.host_gib is not None else "what this machine has available; --host-gib to change it"
        budget_note = ""
        if args.device_gib is not None:
            device_budget = int(args.device_gib * GIB)
        elif device.type == "cpu":
            device_budget = host_budget  # a CPU run's device memory is the host's
        elif machine is not None and machine.device_memory_gib:
            # The machine the plan is for, which need not be this one.
            device_budget = int(machine.device_memory_gib * GIB)
            budget_note = f"{machine.name}'s {DEVICE_MEMORY_KEY}; --device-gib to change it"
        else:
            device_budget = default_device_budget(device)
        return cls(device_budget, host_budget, budget_note, host_note)


def _plan_all(args: argparse.Namespace, *, recipe: str, baseline: int,
              baseline_notes: List[str]) -> Tuple[List[VariantPlan], List[VariantPlan]]:
    """Each variant's plan, and the fine-tunes' where asked, their distinct steps traced first.

    Raises:
        UntraceableModelError: the model cannot be built or traced.
    """
    plans, fine, traces = [], [], {}
    with_fine_tunes = args.fine_tunes and recipe in ("full", "lora")
    requests = step_requests(str(args.config), args.overrides, args.variants.split(","), recipe=recipe,
                             seq_len=args.seq_len, with_fine_tunes=with_fine_tunes)
    trace_steps(requests, traces, jobs=args.jobs)
    for name in args.variants.split(","):
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        plan = plan_variant(str(args.config), args.overrides, name, recipe=recipe, seq_len=args.seq_len,
                            baseline=baseline, traces=traces, nproc_per_node=args.nproc_per_node or 1)
        plan.notes += baseline_notes if plan.problem is None else []
        plans.append(plan)
    if with_fine_tunes:
        print("planning full, LoRA and QLoRA ...", file=sys.stderr, flush=True)
        configured = next((p for p in plans if p.name == "config"), None) or plan_variant(
            str(args.config), args.overrides, "config", recipe=recipe, seq_len=args.seq_len,
            baseline=baseline, traces=traces)
        fine = plan_fine_tunes(str(args.config), args.overrides, configured, seq_len=args.seq_len,
                               baseline=baseline, traces=traces)
    return plans, fine


def _load_config(p: argparse.ArgumentParser, args: argparse.Namespace) -> DictConfig:
    """The config with the command line's overrides merged in; an override the config refuses (a
    ``~key`` it does not have, a component's removal) is a usage error."""
    removal = component_removal_problem(OmegaConf.to_container(OmegaConf.load(args.config)), args.overrides)
    if removal is not None:
        p.error(removal)
    try:
        return load_config(str(args.config), args.overrides)
    except ValueError as err:  # torchtune's merge: a ~key the config does not have
        p.error(f"{' '.join(args.overrides)}: {err}")


def _report(args: argparse.Namespace, cfg: DictConfig, plans: List[VariantPlan], fine: List[VariantPlan], *,
            machine: Optional[Machine], budgets: _Budgets, device: torch.device, seq_len: int) -> None:
    """Prints the plans' table (with each variant's speed on ``machine`` where given) and writes
    ``--json`` where asked."""
    speeds = None if machine is None else {
        p.name: plan_speed(p, machine, device_budget=budgets.device) for p in plans}
    given = OmegaConf.to_container(cfg, resolve=True)
    math_changes = {p.name: math_change(OmegaConf.to_container(variant_config(
        str(args.config), args.overrides, p.name), resolve=True), config=given) for p in plans}
    print(format_plans(plans, device=str(device), device_budget=budgets.device, host_budget=budgets.host,
                       config_path=str(args.config), ranks=args.nproc_per_node,
                       seq_len_note=f"batch {cfg.batch_size} x {seq_len} tokens{' a rank' if args.nproc_per_node else ''}",
                       fine_tunes=_fine_tune_block(fine, cfg, device_budget=budgets.device, host_budget=budgets.host),
                       speeds=speeds, machine=machine.name if machine else "", device_budget_note=budgets.device_note,
                       host_budget_note=budgets.host_note, math_changes=math_changes))
    if args.json:
        _write_json(args.json, plans, fine, speeds=speeds, machine=machine, budgets=budgets, device=device,
                    math_changes=math_changes, ranks=args.nproc_per_node)


def _write_json(path: Path, plans: List[VariantPlan], fine: List[VariantPlan], *, speeds: Optional[dict],
                machine: Optional[Machine], budgets: _Budgets, device: torch.device, math_changes: dict,
                ranks: Optional[int] = None) -> None:
    """``--json``: the budgets, the machine, each plan with its speed, the fastest that fits, the fine-tunes."""
    entries = [asdict(p) for p in plans]
    if speeds is not None:
        for entry in entries:
            speed = speeds[entry["name"]]
            entry["speed"] = None if speed is None else speed.summary()
    fastest = None if speeds is None or str(device) == "cpu" else asdict(fastest_fitting(
        plans, speeds, device_budget=budgets.device, host_budget=budgets.host, math_changes=math_changes))
    path.write_text(json.dumps({"device_budget": budgets.device, "host_budget": budgets.host, "nproc_per_node": ranks,
                                "machine": None if machine is None else {"name": machine.name, **machine.as_dict()},
                                "plans": entries, "fastest": fastest, "fine_tunes": [asdict(p) for p in fine]},
                               indent=1))


def _fine_tune_block(fine: List[VariantPlan], cfg, *, device_budget: Optional[int], host_budget: int) -> str:
    if not fine:
        return ""
    try:
        chosen = describe_optimizer(cfg.optimizer, in_backward=cfg.get("optimizer_in_bwd") is True)
        optimizer = chosen.optimizer_class.__name__ + (", offload_gradients" if chosen.offload_gradients else "")
    except ValueError:  # the fine-tunes' rows say why they cannot run
        optimizer = "?"
    return format_fine_tunes(fine, device_budget=device_budget, host_budget=host_budget, optimizer=optimizer)


if __name__ == "__main__":
    sys.exit(main())
