"""Trains two copies of a tiny model the way torchtune's recipes do, to compare optimizers.

The models are built for poor arithmetic density (thin, wide linears) so that copies, not
compute, dominate on an accelerator, which is where ordering races would show.
"""

import copy
import io
from typing import Callable, List, Optional

import torch
from torch import nn


def tiny_model(*, seed: int = 0, device: str = "cpu", frozen_first: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(24, 96), nn.Tanh(), nn.Linear(96, 160), nn.Tanh(), nn.Linear(160, 8)
    ).to(device)
    if frozen_first:
        model[0].requires_grad_(False)
    return model


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def batches(*, num: int, seed: int = 1, device: str = "cpu") -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(6, 24, generator=g).to(device), torch.randn(6, 8, generator=g).to(device))
        for _ in range(num)
    ]


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: List[tuple],
    *,
    grad_accum: int,
    clip: Optional[float],
    scheduler: Optional[object] = None,
    scale_grads: Callable[[float], None],
    clip_grads: Callable[[float], torch.Tensor],
    after_backward: Optional[Callable[[], None]] = None,
) -> List[float]:
    """Runs len(data) // grad_accum steps; grads are summed, scaled after backward, then clipped."""
    norms = []
    for start in range(0, len(data) - grad_accum + 1, grad_accum):
        for x, y in data[start : start + grad_accum]:
            loss = ((model(x) - y) ** 2).sum()
            loss.backward()
            if after_backward is not None:
                after_backward()
        scale_grads(1.0 / grad_accum)
        if clip is not None:
            norms.append(float(clip_grads(clip)))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def plain_hooks(model: nn.Module):
    """scale/clip callables for a plain optimizer: they act on the model's .grad tensors."""
    params = [p for p in model.parameters() if p.requires_grad]

    def scale(f):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(f)

    def clip(max_norm):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    return scale, clip


def assert_same_params(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, msg=lambda m: f"{name}: {m}", **tol)


def through_a_file(checkpoint: dict) -> dict:
    """``checkpoint`` saved with ``torch.save`` and loaded back, as a resume reads it."""
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def read_saved_states(opt) -> dict:
    """``opt.state_dict()`` with every base-optimizer state tensor read, as a checkpoint's save reads the
    host states and weights (a checked run then sees those reads)."""
    saved = opt.state_dict()
    for value in saved["state"].values():
        for tensor in value["optimizer"]["state"].get(0, {}).values():
            tensor.sum()
    return saved


def assert_same_states(got: dict, want: dict) -> None:
    """Two engine checkpoints (``OffloadOptimizer.state_dict()``) hold the same slots, masters and base
    optimizer states, to the bit, and the same parameter groups."""
    assert got["state"].keys() == want["state"].keys()
    for name, slot in want["state"].items():
        mine = got["state"][name]
        assert (mine["shape"], mine["dtype"], mine["offloaded"]) == (slot["shape"], slot["dtype"], slot["offloaded"])
        assert ("master" in mine) == ("master" in slot)
        if "master" in slot:
            assert torch.equal(mine["master"], slot["master"]), name
        a, b = mine["optimizer"]["state"], slot["optimizer"]["state"]
        assert a.keys() == b.keys() and a[0].keys() == b[0].keys(), name
        for key, value in b[0].items():
            if torch.is_tensor(value):
                assert value.dtype == a[0][key].dtype and torch.equal(a[0][key], value), (name, key)
            else:
                assert a[0][key] == value, (name, key)
        assert mine["optimizer"]["param_groups"] == slot["optimizer"]["param_groups"]
    assert got["param_groups"] == want["param_groups"]
