"""How long the planner takes on this machine, against an earlier tree of the planner run in turns,
and whether its memory figures moved.

Usage: python scripts/bench_planner.py [--config configs/llama3_1/8B_full_offload_engine.yaml ...]
       [--baseline 731dfa5] [--rounds 2] [--machine rtx4090_ddr5] [--reference-seconds 151]

Each round plans every ``--config`` with ``python -m torchtune_offload.plan`` (a process of its own,
``--plan-args`` added, and ``--machine`` so that the speed columns are planned too) and, with
``--baseline``, with the tree of that git revision (``git archive`` into a temporary folder, its
own copy of the config at the same path), the two in turns, each going first every other round.
Wall time is measured around the process, CPU time from its resource usage (user and system,
its worker processes included). The figures column compares each tree's ``--json`` plans: the
largest relative difference of a device, paged or host peak between the trees, over the variants
and fine-tunes both planned, the host peaks less the process baseline that each run measures (it
moves by about 1% of the tiny config's host figure from run to run). The configs themselves may
differ between trees; the table says where.

``--reference-seconds S`` names what the baseline took for the first config on another machine (the
issue 43's 151 s for the 8B full config, on a 2-core AVX2-only EPYC): that machine's time over the
baseline's here gives a factor, and each config's time now is scaled by it, as an estimate of the
planner's time there, assuming that machine is uniformly that much slower. Prints a markdown table
naming the CPU.
"""

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from torchtune_offload.bench.machine import cpu_name

REPO = Path(__file__).resolve().parent.parent
#: The command-line options: name -> (type, default, help).
OPTIONS: Dict[str, tuple] = {
    "--config": (str, None, "a config to plan, relative to the repository (repeatable; default: the 8B full "
                            "offload-engine and QLoRA configs)"),
    "--baseline": (str, None, "a git revision whose planner runs in turns with this one (default: none)"),
    "--rounds": (int, 2, "rounds; each plans every config once with each tree"),
    "--machine": (str, "rtx4090_ddr5", "the --machine this tree's planner gets (speed included); 'none' to leave it out"),
    "--plan-args": (str, "--device-gib 24 --host-gib 128", "arguments both trees' planners get"),
    "--reference-seconds": (float, None, "the baseline's seconds for the first config on another machine"),
}
DEFAULT_CONFIGS = ["configs/llama3_1/8B_full_offload_engine.yaml", "configs/llama3_1/8B_qlora_offload.yaml"]
#: The plans' peaks that the figures column compares.
PEAKS = ("device_bytes", "paged_bytes", "host_bytes")
#: The host part each planner run measures in its own process (``planner.plan_config``).
PROCESS_BASELINE = "this process (Python, PyTorch, torchtune)"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (kind, default, text) in OPTIONS.items():
        if name == "--config":
            parser.add_argument(name, action="append", help=text)
        else:
            parser.add_argument(name, type=kind, default=default, help=text)
    args = parser.parse_args(argv)
    args.config = args.config or list(DEFAULT_CONFIGS)
    missing = [c for c in args.config if not (REPO / c).is_file()]
    if missing:
        parser.error(f"--config: not found under {REPO}: {', '.join(missing)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.reference_seconds is not None and (args.baseline is None or args.reference_seconds <= 0):
        parser.error("--reference-seconds needs --baseline (the tree it was measured with) and a positive number")
    return args


def export_tree(revision: str, folder: Path) -> None:
    """Writes ``revision``'s files into ``folder`` (no checkout, so the repository is left as it is).

    Raises:
        ValueError: naming the revision where git cannot export it.
    """
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision], capture_output=True)
    if archive.returncode != 0:
        raise ValueError(f"--baseline {revision}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)


def plan_once(tree: Path, config: str, args: List[str], json_path: Path) -> Tuple[float, float]:
    """Plans ``config`` with ``tree``'s planner in a process of its own: (wall, CPU) seconds.

    Raises:
        RuntimeError: with the planner's last lines where it fails.
    """
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torchtune_offload.plan", "--config", config, *args,
                           "--json", str(json_path)], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"the planner of {tree} failed on {config} (exit {done.returncode}):\n"
                           + "\n".join(done.stderr.strip().splitlines()[-5:]))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def peaks(json_path: Path) -> Dict[str, Dict[str, Optional[int]]]:
    """Each planned variant's and fine-tune's peaks from a planner's ``--json`` file, the host
    peak less the process baseline the run measured."""
    data = json.loads(json_path.read_text())
    entries = [(p["name"], p) for p in data["plans"]] + [(f"fine-tune {p['name']}", p) for p in data["fine_tunes"]]
    result = {}
    for name, entry in entries:
        figures = {key: entry.get(key) for key in PEAKS}
        if figures["host_bytes"] is not None:
            figures["host_bytes"] -= entry.get("host_parts", {}).get(PROCESS_BASELINE, 0)
        result[name] = figures
    return result


def largest_difference(old: Dict[str, Dict[str, Optional[int]]],
                       new: Dict[str, Dict[str, Optional[int]]]) -> Tuple[float, str]:
    """The largest relative difference of a peak planned by both, and what it was: (fraction, text)."""
    worst, where = 0.0, "identical"
    for name in sorted(old.keys() & new.keys()):
        for key in PEAKS:
            a, b = old[name][key], new[name][key]
            if a is None or b is None or a == b:
                continue
            change = abs(b - a) / a if a else float("inf")
            if change > worst:
                worst, where = change, f"{name} {key.split('_')[0]} {a / 2**30:.2f} -> {b / 2**30:.2f} GiB"
    return worst, where


def spread(values: List[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    common = shlex.split(args.plan_args)
    now_args = common + ([] if args.machine == "none" else ["--machine", args.machine])
    with tempfile.TemporaryDirectory(prefix="bench_planner_") as scratch:
        scratch = Path(scratch)
        trees = {"now": REPO}
        if args.baseline is not None:
            trees[args.baseline] = scratch / "baseline"
            trees[args.baseline].mkdir()
            export_tree(args.baseline, trees[args.baseline])
        times: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
        figures: Dict[str, Tuple[float, str]] = {}
        for round_ in range(args.rounds):
            for config in args.config:
                order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
                for name in order:
                    print(f"round {round_ + 1}: {config} with the planner of {name} ...", file=sys.stderr, flush=True)
                    json_path = scratch / f"{name}.json"
                    times.setdefault((config, name), []).append(
                        plan_once(trees[name], config, now_args if name == "now" else common, json_path))
                if args.baseline is not None:
                    figures[config] = largest_difference(peaks(scratch / f"{args.baseline}.json"),
                                                         peaks(scratch / "now.json"))
        same_config = {c: args.baseline is None or (REPO / c).read_bytes() == (trees[args.baseline] / c).read_bytes()
                       for c in args.config}

    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores (this process may use {len(os.sched_getaffinity(0))}); "
          f"torch {torch.__version__}; {args.rounds} rounds, the trees in turns")
    print(f"Planner arguments: {args.plan_args}; this tree's also --machine {args.machine}")
    print()
    print("| config | planner | wall s | CPU s | baseline / now (wall) | largest peak difference |")
    print("|---|---|---|---|---|---|")
    for config in args.config:
        now = times[config, "now"]
        for name in trees:
            runs = times[config, name]
            ratio = ", ".join(f"{old[0] / new[0]:.2f}x" for old, new in zip(runs, now)) if name != "now" else ""
            figure = ""
            if name != "now":
                worst, where = figures[config]
                figure = f"{worst:.2%} ({where})" + ("" if same_config[config] else "; the config differs between trees")
            print(f"| {config} | {name} | {spread([w for w, _ in runs])} | {spread([c for _, c in runs])} | "
                  f"{ratio} | {figure} |")
    if args.reference_seconds is not None:
        baseline_walls = [w for w, _ in times[args.config[0], args.baseline]]
        factors = [args.reference_seconds / w for w in baseline_walls]
        print()
        print(f"Scaled to the machine where {args.baseline}'s planner took {args.reference_seconds:g} s for "
              f"{args.config[0]} (here {spread(baseline_walls)} s: {min(factors):.2f}-{max(factors):.2f}x slower), "
              "assuming it is uniformly that much slower:")
        for config in args.config:
            walls = [w for w, _ in times[config, "now"]]
            print(f"- {config}: {min(walls) * min(factors):.0f}-{max(walls) * max(factors):.0f} s")


if __name__ == "__main__":
    main()
