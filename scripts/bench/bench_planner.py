"""How long the planner takes on this machine, against an earlier tree of the planner run in turns,
and whether its memory figures moved.

Usage: python scripts/bench/bench_planner.py [--config configs/llama3_1/8B_full_offload_engine.yaml ...]
       [--baseline 731dfa5] [--rounds 2] [--machine rtx4090_ddr5] [--reference-seconds 151]
       [--plan-args="--device-gib 24 --host-gib 128"]

Each round plans every ``--config`` with ``python -m torchtune_offload.plan`` (a process of its own,
``--plan-args`` added, and ``--machine`` so that the speed columns are planned too) and, with
``--baseline``, with the tree of that git revision (``git archive`` into a temporary folder, its
own copy of the config at the same path), the two in turns, each going first every other round.
There is no warm-up run: the first run of the first round also reads the libraries from disk, and
the order swaps each round so that this falls on each tree in turn. Wall time is measured around
the process, CPU time from its resource usage (user and system, its worker processes included).

The figures column compares the two trees' ``--json`` plans of the same config in the same round:
the largest relative difference of a device, paged or host peak, over the variants and fine-tunes
both planned and over the rounds, the host peaks less the process baseline that each run measures
(it moves by about 1% of the tiny config's host figure from run to run). It says how many plans it
compared and names those only one tree made. The configs themselves may differ between trees; the
table says where.

``--reference-seconds S`` names what the baseline took for the first config on another machine (the
151 s measured for the 8B full config on a 2-core AVX2-only EPYC): that machine's time over the
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
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from torchtune_offload.bench.machine import cpu_name

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = ["configs/llama3_1/8B_full_offload_engine.yaml", "configs/llama3_1/8B_qlora_offload.yaml"]
#: The command-line options: name -> (type, default, help).
OPTIONS: Dict[str, tuple] = {
    "--config": (str, DEFAULT_CONFIGS, "a config to plan, relative to the repository (repeatable; default: the "
                                       "8B full offload-engine and QLoRA configs)"),
    "--baseline": (str, None, "a git revision whose planner runs in turns with this one (default: none)"),
    "--rounds": (int, 2, "rounds; each plans every config once with each tree"),
    "--machine": (str, "rtx4090_ddr5", "the --machine this tree's planner gets (speed included); 'none' to "
                                       "leave it out"),
    "--plan-args": (str, "--device-gib 24 --host-gib 128", "arguments both trees' planners get (give them as "
                                                           "--plan-args=\"...\" where they start with a dash)"),
    "--reference-seconds": (float, None, "the baseline's seconds for the first config on another machine"),
}
#: The plans' peaks that the figures column compares.
PEAKS = ("device_bytes", "paged_bytes", "host_bytes")
#: The host part each planner run measures in its own process (``planner.plan_config``).
PROCESS_BASELINE = "this process (Python, PyTorch, torchtune)"
#: The two trees, as the tables name them: this working tree, and the ``--baseline`` revision's.
NOW, OLD = "now", "old"


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, (kind, default, text) in OPTIONS.items():
        if name == "--config":
            parser.add_argument(name, action="append", help=text)
        else:
            parser.add_argument(name, type=kind, default=default, help=text)
    args = parser.parse_args(argv)
    args.config = args.config or list(OPTIONS["--config"][1])
    missing = [c for c in args.config if not (REPO / c).is_file()]
    if missing:
        parser.error(f"--config: not found under {REPO}: {', '.join(missing)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.reference_seconds is not None and (args.baseline is None or args.reference_seconds <= 0):
        parser.error("--reference-seconds needs --baseline (the tree it was measured with) and a positive number")
    if args.baseline is not None:
        known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                                f"{args.baseline}^{{commit}}"], capture_output=True)
        if known.returncode != 0:
            parser.error(f"--baseline: {args.baseline} is not a commit of the repository at {REPO}")
    return args


def export_tree(revision: str, folder: Path, configs: Sequence[str]) -> None:
    """Writes ``revision``'s files into ``folder`` (no checkout, so the repository is left as it is).

    Raises:
        ValueError: naming the revision where git cannot export it, or the configs its tree lacks.
    """
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", revision], capture_output=True)
    if archive.returncode != 0:
        raise ValueError(f"--baseline {revision}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive.stdout, check=True)
    missing = [c for c in configs if not (folder / c).is_file()]
    if missing:
        raise ValueError(f"--config: not in --baseline {revision}'s tree: {', '.join(missing)}")


def plan_once(tree: Path, config: str, args: List[str], json_path: Path) -> Tuple[float, float]:
    """Plans ``config`` with ``tree``'s planner in a process of its own: (wall, CPU) seconds.

    Raises:
        RuntimeError: with the planner's last lines where it fails or writes no ``--json``.
    """
    json_path.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torchtune_offload.plan", "--config", config, *args,
                           "--json", str(json_path)], cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not json_path.is_file():
        raise RuntimeError(f"the planner of {tree} failed on {config} (exit {done.returncode}"
                           f"{'' if json_path.is_file() else ', no --json written'}):\n"
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


def compared(old: Dict[str, dict], new: Dict[str, dict]) -> str:
    """How many plans both trees made, and those only one did."""
    text = f"{len(old.keys() & new.keys())} plans compared"
    for label, only in ((OLD, old.keys() - new.keys()), (NOW, new.keys() - old.keys())):
        if only:
            text += f"; only {label}: {', '.join(sorted(only))}"
    return text


def scaled(reference_seconds: float, baseline_walls: Sequence[float],
           walls: Sequence[float]) -> Tuple[float, float, float, float]:
    """The factor by which a machine that took ``reference_seconds`` for what took
    ``baseline_walls`` here is slower, and ``walls`` scaled by it: (least factor, most factor,
    least estimate, most estimate)."""
    factors = [reference_seconds / w for w in baseline_walls]
    return min(factors), max(factors), min(walls) * min(factors), max(walls) * max(factors)


def joined(seconds: Sequence[float]) -> str:
    """Seconds of each round, to a tenth, comma-separated."""
    return ", ".join(f"{s:.1f}" for s in seconds)


def print_scaled(times: Dict[Tuple[str, str], List[Tuple[float, float]]], *, reference_seconds: float,
                 baseline: str, configs: Sequence[str]) -> None:
    """Prints each config's time on this tree scaled to the machine where the baseline's planner took
    ``reference_seconds`` for the first config (:func:`scaled`).

    Args:
        times: each round's (wall, CPU) seconds by (config, tree).
        reference_seconds: ``--reference-seconds``.
        baseline: the baseline's revision.
        configs: the configs, the first the one ``reference_seconds`` is for.
    """
    baseline_walls = [w for w, _ in times[configs[0], OLD]]
    least, most, _, _ = scaled(reference_seconds, baseline_walls, baseline_walls)
    print()
    print(f"Scaled to the machine where {baseline}'s planner took {reference_seconds:g} s for "
          f"{configs[0]} (here {joined(baseline_walls)} s: {least:.2f}-{most:.2f}x slower), "
          "assuming it is uniformly that much slower:")
    for config in configs:
        _, _, low, high = scaled(reference_seconds, baseline_walls, [w for w, _ in times[config, NOW]])
        print(f"- {config}: {low:.0f}-{high:.0f} s")


def main(argv: Optional[List[str]] = None) -> None:
    args = parse_args(argv)
    common = shlex.split(args.plan_args)
    now_args = common + ([] if args.machine == "none" else ["--machine", args.machine])
    labels = {NOW: NOW, OLD: args.baseline}
    with tempfile.TemporaryDirectory(prefix="bench_planner_") as scratch:
        scratch = Path(scratch)
        trees = {NOW: REPO}
        if args.baseline is not None:
            trees[OLD] = scratch / "baseline"
            trees[OLD].mkdir()
            export_tree(args.baseline, trees[OLD], args.config)
        times: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
        figures: Dict[str, Tuple[float, str]] = {}
        plans_compared: Dict[str, str] = {}
        for round_ in range(args.rounds):
            for index, config in enumerate(args.config):
                order = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
                for tree in order:
                    print(f"round {round_ + 1}: {config} with the planner of {labels[tree]} ...", file=sys.stderr,
                          flush=True)
                    times.setdefault((config, tree), []).append(
                        plan_once(trees[tree], config, now_args if tree == NOW else common,
                                  scratch / f"{index}-{tree}.json"))
                if OLD in trees:
                    old, new = peaks(scratch / f"{index}-{OLD}.json"), peaks(scratch / f"{index}-{NOW}.json")
                    figures[config] = max(figures.get(config, (0.0, "identical")), largest_difference(old, new),
                                          key=lambda pair: pair[0])
                    plans_compared[config] = compared(old, new)
        same_config = {c: OLD not in trees or (REPO / c).read_bytes() == (trees[OLD] / c).read_bytes()
                       for c in args.config}

    print(f"CPU: {cpu_name()}; {os.cpu_count()} cores (this process may use {len(os.sched_getaffinity(0))}); "
          f"torch {torch.__version__}; {args.rounds} rounds, the trees in turns")
    machine = "nothing more" if args.machine == "none" else f"also --machine {args.machine}"
    print(f"Planner arguments: {args.plan_args}; this tree's {machine}")
    print()
    print("| config | planner | wall s | CPU s | baseline / now (wall) | largest peak difference |")
    print("|---|---|---|---|---|---|")
    for config in args.config:
        now = times[config, NOW]
        for tree in trees:
            runs = times[config, tree]
            ratio = figure = ""
            if tree == OLD:
                ratio = ", ".join(f"{old[0] / new[0]:.2f}x" for old, new in zip(runs, now))
                worst, where = figures[config]
                figure = f"{worst:.2%} ({where}; {plans_compared[config]})"
                figure += "" if same_config[config] else "; the config differs between trees"
            print(f"| {config} | {labels[tree]} | {joined([w for w, _ in runs])} | {joined([c for _, c in runs])} | "
                  f"{ratio} | {figure} |")
    if args.reference_seconds is not None:
        print_scaled(times, reference_seconds=args.reference_seconds, baseline=args.baseline, configs=args.config)


if __name__ == "__main__":
    main()
