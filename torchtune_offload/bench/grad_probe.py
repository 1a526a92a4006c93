"""An AdamW that records the norm of the gradients it steps on, to show what an optimizer really sees.

Recipes scale and clip gradients before ``optimizer.step()``; an optimizer that copies gradients to
the host during backward may step on something else. Name this class as the (host) optimizer and set
``TORCHTUNE_OFFLOAD_GRAD_PROBE=<file>``: every ``step()`` appends one JSON line ``{"step": n,
"sumsq": s, "numel": k}`` (n: that optimizer's step count after the step, s: the sum of squared
gradient entries it stepped on). Offloading optimizers run one inner optimizer per parameter; the
lines of one training step share ``n``, so the global norm of step ``n`` is ``sqrt(sum of its s)``.
"""

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Dict, Union

import torch

ENV = "TORCHTUNE_OFFLOAD_GRAD_PROBE"


class GradNormProbeAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that appends the norm of each step's gradients to the file ``$TORCHTUNE_OFFLOAD_GRAD_PROBE``."""

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        sumsq = sum(float(g.double().square().sum()) for g in grads)
        loss = super().step(closure)
        path = os.environ.get(ENV)
        if path and grads:
            first = next(p for g in self.param_groups for p in g["params"] if p.grad is not None)
            step = int(self.state[first]["step"])
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "sumsq": sumsq, "numel": sum(g.numel() for g in grads)}) + "\n")
        return loss


def read_probe(path: Union[str, Path]) -> Dict[int, float]:
    """Global gradient norm per training step from a probe file (lines of one step summed)."""
    sums: Dict[int, float] = defaultdict(float)
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        sums[row["step"]] += row["sumsq"]
    return {step: math.sqrt(s) for step, s in sorted(sums.items())}
