"""Loss curves of the 78M llama3_2_mid in bf16, with bf16 device weights and with FP8 device weights.

Usage: python scripts/bench/quality_fp8.py [--steps 300] [--every 20] [--batch-size 4] [--seq-len 16]
                                           [--vocab 1024] [--samples 64] [--lr 1e-3] [--threads N] [--plot PNG]
                                           [--runs bf16,fp8,fp8_per_tensor] [--json CURVES] [--force]

Three runs of ``torchtune_offload.OffloadOptimizer`` around ``torch.optim.AdamW`` on the CPU emulation
path, each on its own copy of the same random-init bf16 model, on the same batches in the same order
with the same hyper-parameters (the data and init of ``scripts/bench/quality_8bit.py``): ``device_weights``
unset (bf16 weights, the reference), ``fp8`` (per-row scales) and ``fp8_per_tensor``. The host
weights of all three are stepped exactly as plain AdamW would step them on the gradients each run
computes; only the weights the forward and backward use differ.

Prints a markdown table naming the CPU: every ``--every`` steps, each run's loss averaged over the
last ``--every`` steps (the step's own loss in the first row), then each FP8 run's final mean against
the reference's, and wall times. ``--plot`` also writes the curves as a PNG (matplotlib).
"""

import argparse
import copy
import math
import statistics
import time
import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from torchtune_offload import OffloadOptimizer
from torchtune_offload.assets import init_tensor
from torchtune_offload.bench.arguments import check_output_file
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.bench.quality import add_run_arguments, epoch_batches, loss_table, train_steps
from torchtune_offload.models import llama3_2_mid

#: ``--runs`` name -> (column name, ``device_weights``).
RUNS: Dict[str, Tuple[str, Optional[str]]] = {
    "bf16": ("bf16 device weights", None),
    "fp8": ("fp8, per-row scales", "fp8"),
    "fp8_per_tensor": ("fp8, per-tensor scales", "fp8_per_tensor"),
}
REFERENCE = RUNS["bf16"][0]


def train(name: str, model: torch.nn.Module, device_weights: Optional[str], steps: List[torch.Tensor],
          args: argparse.Namespace) -> List[float]:
    opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", device_weights=device_weights,
                           lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=args.weight_decay)
    opt.register_forward_waits(model)
    losses = train_steps(name, model, opt, steps, every=args.every, widen_logits=True)
    opt.close()
    return losses


def plot(curves: Dict[str, List[float]], path: str, title: str) -> None:
    import matplotlib  # optional: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _parse_args() -> Tuple[argparse.Namespace, List[str]]:
    """The command line, checked before any run (a bad value exits through ``parser.error``), and the
    runs it names."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=300)
    parser.add_argument("--plot", default=None, help="write the loss curves to this PNG (needs matplotlib)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"which runs, of {', '.join(RUNS)} (default all; "
                        "bf16, where given, is the reference of the final comparison)")
    parser.add_argument("--json", default=None, help="write the curves here after each run (partial results "
                        "survive a run cut short); a new file, unless --force")
    parser.add_argument("--force", action="store_true", help="replace existing --json and --plot files")
    args = parser.parse_args()
    # Before the runs: a bad path found after them would lose their results.
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            check_output_file(parser, Path(path), flag=flag, force=args.force)
    if args.vocab > 128_256:
        parser.error("--vocab must be at most 128256, llama3_2_mid's vocabulary")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2 (the loss predicts each next token)")
    runs = args.runs.split(",")
    if not runs or any(r not in RUNS for r in runs) or len(set(runs)) != len(runs):
        parser.error(f"--runs: a comma-separated list of distinct runs from {', '.join(RUNS)}")
    return args, runs


def _initial_model(*, seed: int) -> torch.nn.Module:
    """llama3_2_mid in bf16, its weights drawn as the random-init checkpoints draw them."""
    initial = llama3_2_mid()
    with torch.no_grad():
        # The random-init checkpoints' scheme, as scripts/bench/quality_8bit.py uses it.
        for name, p in initial.named_parameters():
            p.copy_(init_tensor(name=name, meta=p, num_layers=len(initial.layers), seed=seed,
                                dtype=torch.float32))
    return initial.to(torch.bfloat16)


def main() -> None:
    args, runs = _parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps = epoch_batches(seq_len=args.seq_len, num_samples=args.samples, vocab_size=args.vocab, seed=args.seed,
                          steps=args.steps, batch_size=args.batch_size)
    initial = _initial_model(seed=args.seed)
    numel = sum(p.numel() for p in initial.parameters())
    header = (f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; llama3_2_mid "
              f"({numel / 1e6:.1f}M parameters, bf16, random init, seed {args.seed}); {args.steps} steps of "
              f"{args.batch_size} x {args.seq_len} tokens drawn below {args.vocab} ({args.samples} sequences, "
              f"reshuffled each epoch); OffloadOptimizer(AdamW), lr {args.lr:g} constant, betas (0.9, 0.999), "
              f"eps 1e-8, weight decay {args.weight_decay:g}; log({args.vocab}) = {math.log(args.vocab):.4f}")
    print(header + "\n")
    curves, seconds = {}, {}
    for run in runs:
        name, device_weights = RUNS[run]
        start = time.perf_counter()
        curves[name] = train(name, copy.deepcopy(initial), device_weights, steps, args)
        seconds[name] = time.perf_counter() - start
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"header": header, "curves": curves, "seconds": seconds}, f)
    print(f"Loss, mean over the {args.every} steps up to each row (row 1: the first step's loss)\n")
    print("\n".join(loss_table(curves, args.every)))
    last = slice(-min(20, args.steps), None)
    means = {n: statistics.fmean(c[last]) for n, c in curves.items()}
    reference = means.get(REFERENCE)
    print()
    print("mean loss of the last {} steps: {}".format(
        len(next(iter(curves.values()))[last]),
        ", ".join(f"{n} {m:.4f}" + (f" ({(m - reference) / reference:+.2%})" if reference else "")
                  for n, m in means.items())))
    print("wall time: " + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items()))
    if args.plot:
        plot(curves, args.plot, f"llama3_2_mid bf16, {args.steps} steps, CPU")
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
