"""What the quality scripts (``scripts/bench/quality_8bit.py``, ``scripts/bench/quality_fp8.py``) share: the
seeded order of the synthetic samples each step trains on, and the table of loss curves."""

import argparse
import statistics
import sys
from typing import Dict, List

import torch
import torch.nn.functional as F

from torchtune_offload.bench.arguments import non_negative_number, positive_int, positive_number
from torchtune_offload.data import SyntheticTokens


def add_run_arguments(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The options both quality scripts take: the run's length, its data and AdamW's settings.

    Args:
        parser: the script's parser.
        steps: the default number of optimizer steps per run.
    """
    parser.add_argument("--steps", type=positive_int, default=steps, help=f"optimizer steps per run (default {steps})")
    parser.add_argument("--every", type=positive_int, default=20, help="a table row every this many steps (default 20)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--vocab", type=positive_int, default=1024, help="token ids are drawn below this (default 1024)")
    parser.add_argument("--samples", type=positive_int, default=64, help="distinct sequences, repeated (default 64)")
    parser.add_argument("--lr", type=positive_number, default=1e-3, help="learning rate, constant (default 1e-3)")
    parser.add_argument("--weight-decay", type=non_negative_number, default=0.01, help="AdamW's weight decay (default 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's init and of the data (default 0)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")


def train_steps(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: List[torch.Tensor], *,
                every: int, widen_logits: bool = False) -> List[float]:
    """Trains ``model`` one optimizer step per batch of ``steps`` (next-token loss) and returns the
    losses, a progress line on stderr every ``every`` steps (a run takes minutes).

    Args:
        widen_logits: take the loss of fp32 logits (for a bf16 model).
    """
    losses = []
    for tokens in steps:
        logits = model(tokens[:, :-1])
        logits = logits.float() if widen_logits else logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if len(losses) % every == 0:
            print(f"{name}: step {len(losses)}, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    return losses


def epoch_batches(*, seq_len: int, num_samples: int, vocab_size: int, seed: int, steps: int,
                  batch_size: int) -> List[torch.Tensor]:
    """Every step's ``(batch_size, seq_len)`` token ids: the samples in one seeded order per epoch."""
    data = SyntheticTokens(seq_len=seq_len, num_samples=num_samples, vocab_size=vocab_size, seed=seed)
    samples = torch.tensor([data[i]["tokens"] for i in range(len(data))])
    gen = torch.Generator().manual_seed(seed)
    order: List[int] = []
    while len(order) < steps * batch_size:
        order += torch.randperm(len(data), generator=gen).tolist()
    index = torch.tensor(order[:steps * batch_size]).view(steps, batch_size)
    return [samples[i] for i in index]


def loss_table(curves: Dict[str, List[float]], every: int) -> List[str]:
    """Markdown rows: each curve's mean loss over the ``every`` steps up to each row's step (the
    first step alone, then every ``every`` steps, and the last)."""
    names = list(curves)
    lines = ["| step | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]
    steps = len(next(iter(curves.values())))
    rows = [1] + list(range(every, steps + 1, every))
    if rows[-1] != steps:
        rows.append(steps)
    for step in rows:
        window = slice(max(step - every, 0), step) if step > 1 else slice(0, 1)
        cells = [f"{statistics.fmean(curves[n][window]):.4f}" for n in names]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines
