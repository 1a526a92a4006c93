"""One rank of the distributed recipe: what FSDP2 holds on its device, from parameter shapes alone.

FSDP2 (``fully_shard``, applied by ``distributed/policies.py``) keeps 1/N of each parameter on each
of N ranks: dim 0 cut into N chunks of ``ceil(rows / N)`` rows, every rank's shard allocated at
that padded size (``recipe/checks/fit.py``'s ``meta_shard``), and its gradient the same. A unit (a transformer layer, the token
embedding, ...; the root holds what no unit claims) is all-gathered into whole, padded parameters
before it runs and freed after; its whole gradients are reduce-scattered into the shards when its
backward ends. :func:`fsdp_peak` replays those allocations as torch 2.13's
``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py`` makes them (``unshard``,
``wait_for_unshard``, ``post_backward``, ``_backward_prefetch``), one unit after another:

- forward: a unit's all-gather buffer (its whole parameters, flat) is kept until the next unit's
  copy-out (to overlap it with the next all-gather), so at a unit's all-gather the previous unit's
  buffer, its own and (without ``reshard_after_forward``) every earlier unit's parameters are alive;
  at its copy-out its buffer and its parameters;
- backward: the unit's parameters, the next unit's all-gather (prefetched), this unit's whole
  gradients, the previous unit's reduce-scatter input (kept until this unit's reduce-scatter starts)
  and, at the reduce-scatter, its own input beside the gradients it was copied from and its output;
- the root is gathered for the whole step, and its whole gradients are counted from the start of
  the backward (the output projection's is the first made; the root is reduce-scattered last).

A rank's device peak (the planner's ``plan_config``) is then its parameter and gradient shards, the
buffers (not sharded), the optimizer's device state, :func:`fsdp_peak` and the activations and
temporaries at their own peak, which the one-device trace of the same model at the per-rank batch
gives (``StepTrace.working_bytes``): every rank runs the whole model on its own ``batch_size``
samples, on parameters gathered whole. Each part is taken at its own largest, as if they met: an
upper bound (FSDP2's peak is in the backward or the forward's first gathers, the activations' at
the loss).
"""

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig
from torch import nn

from torchtune_offload.distributed.policies import plan_shard, shard_policy_of
from torchtune_offload.recipe import RecipeSettings
from torchtune_offload.recipe.checks.fit import meta_model, meta_shard

#: The root unit's name in :class:`Unit` lists and in :func:`fsdp_peak`'s answer.
ROOT = "<root>"


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit, as a rank gathers it.

    Attributes:
        name: the module's name (:data:`ROOT` for the root).
        param_bytes: its parameters gathered whole (every rank's padded shard).
        grad_bytes: the same of its trainable parameters (their whole gradients).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    #: The root's: the gradients made before any unit's backward (the output projection's and the
    #: final norm's, registered after the last unit), the rest (the embedding's) coming last.
    early_grad_bytes: int = 0


def output_is_unit(cfg: DictConfig, settings: RecipeSettings) -> bool:
    """Whether ``cfg``'s shard policy makes the output projection a unit of its own, for which the
    recipe's chunked loss projects once (``distributed/loss.py``)."""
    return "output" in plan_shard(meta_model(cfg.model, settings), shard_policy_of(cfg)).units


def fsdp_units(model: nn.Module, cfg: DictConfig, *, world_size: int) -> List[Unit]:
    """The root, then the units of ``cfg``'s shard policy in the order the forward runs them (the
    order the model registers them, as a torchtune decoder calls them), each with its bytes gathered
    over ``world_size`` ranks (``model`` on the meta device)."""
    names = plan_shard(model, shard_policy_of(cfg)).units
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    names = sorted(names, key=lambda n: order.get(n, -1))
    sizes: Dict[str, List[int]] = {name: [0, 0, 0] for name in [ROOT, *names]}
    after_units = False  # the root's parameters registered after the last unit's run after it
    for pname, param in model.named_parameters():
        owner = max((n for n in names if pname.startswith(n + ".")), key=len, default=ROOT)
        after_units = (after_units or owner == names[-1]) if names else False
        whole = world_size * meta_shard(param, world_size).numel() * param.element_size()
        trainable = whole if param.requires_grad else 0
        sizes[owner][0] += whole
        sizes[owner][1] += trainable
        sizes[owner][2] += trainable if owner == ROOT and after_units else 0
    return [Unit(name, *sizes[name]) for name in [ROOT, *names]]


@dataclass(frozen=True)
class FsdpPeak:
    """:func:`fsdp_peak`'s answer: the most FSDP2 holds beyond the shards at once, and when.

    Attributes:
        bytes: that peak.
        where: the moment, in words (``backward of layers.30: ...``).
        parts: what is alive then, by label.
    """

    bytes: int
    where: str
    parts: Dict[str, int]


class _Replay:
    """The allocations of :func:`fsdp_peak`, with the largest moment kept."""

    def __init__(self) -> None:
        self.alive: Dict[str, int] = {}
        self.peak = FsdpPeak(0, "", {})

    def alloc(self, label: str, size: int, where: str) -> None:
        self.alive[label] = size
        total = sum(self.alive.values())
        if total > self.peak.bytes:
            self.peak = FsdpPeak(total, where, dict(self.alive))

    def free(self, *labels: str) -> None:
        for label in labels:
            self.alive.pop(label, None)


def fsdp_peak(units: List[Unit], *, world_size: int, reshard_after_forward: bool,
              cpu_offload: bool = False) -> FsdpPeak:
    """The most one rank's device holds at once beyond its shards: gathered parameters, all-gather
    and reduce-scatter buffers and whole gradients, over a forward and a backward (module docstring).

    Args:
        units: :func:`fsdp_units` (the root first, then the forward's order).
        world_size: ranks; with one, FSDP2 copies the shard into the whole parameter (no buffer).
        reshard_after_forward: ``fsdp_reshard_after_forward``.
        cpu_offload: ``fsdp_cpu_offload``: a unit's shards are copied to the device for its all-gather.
    """
    replay = _Replay()
    root, rest = units[0], units[1:]

    def gather_buffer(u: Unit) -> int:
        if world_size == 1:
            return 0
        return u.param_bytes + (u.param_bytes // world_size if cpu_offload else 0)

    previous = None  # the forward keeps a unit's all-gather buffer until the end of the next unit's copy-out
    for u in [root, *rest]:
        where = f"forward of {u.name}"
        replay.alloc(f"all-gather buffer of {u.name}", gather_buffer(u), f"{where}: its all-gather")
        replay.alloc(f"parameters of {u.name}", u.param_bytes, f"{where}: its copy-out")
        replay.free(*([previous] if previous else []))
        previous = f"all-gather buffer of {u.name}"
        if reshard_after_forward and u is not root:
            replay.free(f"parameters of {u.name}")
    replay.free(previous)
    backward = [root, *reversed(rest)]
    replay.alloc(f"gradients of {ROOT}", root.early_grad_bytes, f"backward of {ROOT}: the output's gradient")
    kept = None  # the reduce-scatter input FSDP2 keeps until the next unit's
    for i, u in enumerate(backward):
        where = f"backward of {u.name}"
        if f"parameters of {u.name}" not in replay.alive:
            if f"all-gather buffer of {u.name}" not in replay.alive:  # not prefetched
                replay.alloc(f"all-gather buffer of {u.name}", gather_buffer(u), f"{where}: its all-gather")
            replay.alloc(f"parameters of {u.name}", u.param_bytes, f"{where}: its copy-out")
            replay.free(f"all-gather buffer of {u.name}")
        if i + 1 < len(backward) and f"parameters of {backward[i + 1].name}" not in replay.alive:
            nxt = backward[i + 1]
            replay.alloc(f"all-gather buffer of {nxt.name}", gather_buffer(nxt), f"{where}: {nxt.name} prefetched")
        if u is root:
            continue  # the root's backward ends last
        replay.alloc(f"gradients of {u.name}", u.grad_bytes, f"{where}: its gradients")
        _reduce_scatter(replay, u, kept, world_size=world_size, where=where)
        kept = f"reduce-scatter input of {u.name}"
    replay.alloc(f"gradients of {ROOT}", root.grad_bytes, f"backward of {ROOT}: the embedding's gradient")
    _reduce_scatter(replay, root, kept, world_size=world_size, where=f"backward of {ROOT}")
    return replay.peak


def _reduce_scatter(replay: _Replay, u: Unit, kept: Optional[str], *, world_size: int, where: str) -> None:
    """``post_backward``: the unit's parameters freed, the previous reduce-scatter input released,
    its own input made and the whole gradients copied into it and freed (``foreach_reduce``), then
    its output (a shard's: the gradient shard itself in the first micro-batch, added into it and
    freed in later ones, counted here as the latter)."""
    replay.free(f"parameters of {u.name}", *([kept] if kept else []))
    replay.alloc(f"reduce-scatter input of {u.name}", u.grad_bytes, f"{where}: its reduce-scatter")
    replay.free(f"gradients of {u.name}")
    replay.alloc(f"reduce-scatter output of {u.name}", -(-u.grad_bytes // world_size), f"{where}: its reduce-scatter")
    replay.free(f"reduce-scatter output of {u.name}")


def shard_bytes(model: nn.Module, *, world_size: int) -> Tuple[int, int]:
    """One rank's parameter and gradient shards (padded), in bytes."""
    params = [(meta_shard(p, world_size), p.requires_grad) for p in model.parameters()]
    size = [t.numel() * t.element_size() for t, _ in params]
    return sum(size), sum(s for s, (_, trainable) in zip(size, params) if trainable)
