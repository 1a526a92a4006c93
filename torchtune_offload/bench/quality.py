"""What the quality scripts (``scripts/bench/quality_8bit.py``, ``scripts/bench/quality_fp8.py``) share: the
seeded order of the synthetic samples each step trains on, and the table of loss curves."""

import statistics
from typing import Dict, List

import torch

from torchtune_offload.data import SyntheticTokens


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
