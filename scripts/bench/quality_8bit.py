"""Loss curves of the 78M llama3_2_mid trained with fp32 AdamW, bitsandbytes' AdamW8bit and ours, side by side.

Usage: python scripts/bench/quality_8bit.py [--steps 200] [--every 20] [--batch-size 4] [--seq-len 16]
                                            [--vocab 1024] [--samples 64] [--lr 1e-3] [--threads N]

Each optimizer trains its own copy of the same random-init model (torchtune_offload.models.llama3_2_mid,
fp32 weights, one seed) on the same batches, in the same order, with the same hyper-parameters:
``torch.optim.AdamW`` (fp32 states), ``bitsandbytes.optim.AdamW8bit`` (its CPU backend) and
``torchtune_offload.AdamW8bit`` (the fused C pass). The data are generated token sequences
(``torchtune_offload.data.SyntheticTokens``) with ids drawn below ``--vocab`` and ``--samples``
sequences repeated epoch after epoch, so the loss first falls to the drawn vocabulary's entropy
(log of ``--vocab``) and then below it as the model memorises the sequences: both phases depend on
the optimizer. The model keeps Llama 3.2's full 128256-token vocabulary (its tied embedding is 66M of
the 78M parameters), so short sequences keep a step within a CPU's reach.

Prints a markdown table naming the CPU: every ``--every`` steps, each optimizer's loss averaged over
the last ``--every`` steps (the step's own loss in the first row), then the largest gap between the
two 8-bit curves and between bitsandbytes' and fp32 AdamW's, and each run's wall time.
"""

import argparse
import copy
import math
import statistics
import time
from typing import Callable, Dict, List

import torch

from torchtune_offload import AdamW8bit
from torchtune_offload.assets import init_tensor
from torchtune_offload.bench.machine import cpu_name
from torchtune_offload.bench.quality import add_run_arguments, epoch_batches, loss_table, train_steps
from torchtune_offload.models import llama3_2_mid


def _bitsandbytes_adamw8bit(params, **options):
    import bitsandbytes  # optional: only this script's comparison column needs it

    return bitsandbytes.optim.AdamW8bit(params, **options)


OPTIMIZERS: Dict[str, Callable[..., torch.optim.Optimizer]] = {
    "torch AdamW (fp32 states)": lambda params, **o: torch.optim.AdamW(params, **o),
    "bitsandbytes AdamW8bit": _bitsandbytes_adamw8bit,
    "torchtune_offload AdamW8bit": lambda params, **o: AdamW8bit(params, **o),
}


def train(name: str, model: torch.nn.Module, make_optimizer: Callable[..., torch.optim.Optimizer],
          steps: List[torch.Tensor], args: argparse.Namespace) -> List[float]:
    opt = make_optimizer(model.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                         weight_decay=args.weight_decay)
    return train_steps(name, model, opt, steps, every=args.every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(parser, steps=200)
    args = parser.parse_args()
    if args.vocab > 128_256:
        parser.error("--vocab must be at most 128256, llama3_2_mid's vocabulary")
    if args.seq_len < 2:
        parser.error("--seq-len must be at least 2 (the loss predicts each next token)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    steps = epoch_batches(seq_len=args.seq_len, num_samples=args.samples, vocab_size=args.vocab, seed=args.seed,
                          steps=args.steps, batch_size=args.batch_size)
    initial = llama3_2_mid()
    with torch.no_grad():
        # The random-init checkpoints' scheme (normal, std 0.02, residual outputs scaled by depth): the
        # first loss is about log(128256), not the hundreds torchtune's unit-variance embedding gives.
        for name, p in initial.named_parameters():
            p.copy_(init_tensor(name=name, meta=p, num_layers=len(initial.layers), seed=args.seed,
                                dtype=torch.float32))
    numel = sum(p.numel() for p in initial.parameters())
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; llama3_2_mid "
          f"({numel / 1e6:.1f}M parameters, fp32, random init, seed {args.seed}); {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens drawn below {args.vocab} ({args.samples} sequences, "
          f"reshuffled each epoch); lr {args.lr:g} constant, betas (0.9, 0.999), eps 1e-8, weight decay "
          f"{args.weight_decay:g}; log({args.vocab}) = {math.log(args.vocab):.4f}\n")
    curves, seconds = {}, {}
    for name, make in OPTIMIZERS.items():
        start = time.perf_counter()
        curves[name] = train(name, copy.deepcopy(initial), make, steps, args)
        seconds[name] = time.perf_counter() - start
    print(f"Loss, mean over the {args.every} steps up to each row (row 1: the first step's loss)\n")
    print("\n".join(loss_table(curves, args.every)))
    fp32, bnb, ours = curves.values()
    last = slice(-min(args.every, args.steps), None)
    print()
    print(f"largest per-step loss gap, ours vs bitsandbytes: {max(abs(a - b) for a, b in zip(ours, bnb)):.4f}; "
          f"bitsandbytes vs fp32 AdamW: {max(abs(a - b) for a, b in zip(bnb, fp32)):.4f}; "
          f"ours vs fp32 AdamW: {max(abs(a - b) for a, b in zip(ours, fp32)):.4f}")
    print("mean loss of the last {} steps: {}".format(
        len(fp32[last]), ", ".join(f"{n} {statistics.fmean(c[last]):.4f}" for n, c in curves.items())))
    print("wall time: " + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items()))


if __name__ == "__main__":
    main()
