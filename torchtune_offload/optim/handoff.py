"""The backward hand-off of :class:`~torchtune_offload.OffloadOptimizer`: gradients handed to the
engine once per group of parameters, not once per parameter.

A backward completes the parameters' gradients one by one (torch calls each parameter's
post-accumulate-grad hook). The engine's work on a gradient (its norm, its copy or addition towards
the host, the overlap's landing and step) runs on the thread that launches the model's kernels, so
its Python is time the GPU may wait. As DDP's reducer fires per bucket and FSDP2 per
``fully_shard`` unit, the engine collects the gradients of a *group* and hands them over together
once the group's last one is complete: the per-parameter hook only counts. With
``OffloadOptimizer(handoff="parameter")`` each parameter is a group of its own, as before grouping.

A group is a transformer layer (every parameter named ``...layers.<i>....``, as torchtune names
them) or, for the other parameters, a run of consecutive ones (no layer's between them) of at most
:data:`BUCKET_BYTES` (one larger parameter alone). A group whose gradients do not all arrive in a
backward (a parameter the loss does not reach) is handed over at the end of that backward (a
callback queued on autograd's engine), and any group still collected when the optimizer is next
asked for its gradients (a backward that raised) first. A gradient therefore stays where it is
until its group is complete: with gradients offloaded, at most one group's gradients longer than
with a hand-off per parameter.

The order of the work is the gradients' arrival order within each group, and the groups' order
of completion; every result of the engine (norms combined in parameter order, sums added in
micro-batch order) is the same as with a hand-off per parameter, to the bit.
"""

import re
from typing import Callable, Dict, List, Optional, Sequence

import torch

#: The largest run of parameters outside the transformer layers handed over together (DDP's
#: default bucket).
BUCKET_BYTES = 25 * 2**20
#: A transformer layer's prefix in a parameter's name: ``layers.<i>.`` at the start or after a dot.
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")


def layer_prefix(name: str) -> str:
    """The name of the transformer layer a parameter or module name lies in (``"layers.3"``, or
    ``"model.layers.3"``), or ``""`` for one outside every layer."""
    match = _LAYER.search(name + ".")
    return name[: match.end() - 1] if match else ""


def handoff_groups(names: Sequence[str], nbytes: Sequence[int], *, bucket_bytes: int = BUCKET_BYTES,
                   per_parameter: bool = False) -> List[int]:
    """The hand-off group of each parameter, by position: one per transformer layer, and runs of
    consecutive other parameters of at most ``bucket_bytes`` in all.

    Args:
        names: the parameters' names, in the optimizer's order.
        nbytes: their sizes in bytes.
        bucket_bytes: the largest run of non-layer parameters in one group.
        per_parameter: each parameter its own group (``handoff="parameter"``).
    """
    if per_parameter:
        return list(range(len(names)))
    groups: List[int] = []
    layers: Dict[str, int] = {}
    bucket, filled, count = -1, 0, 0
    for name, size in zip(names, nbytes):
        layer = layer_prefix(name)
        if layer:
            if layer not in layers:
                layers[layer] = count
                count += 1
            groups.append(layers[layer])
            bucket = -1  # a bucket joins neighbours only: its members' gradients arrive together
            continue
        if bucket < 0 or filled + size > bucket_bytes:
            bucket, filled = count, 0
            count += 1
        filled += size
        groups.append(bucket)
    return groups


class BackwardHandoff:
    """Collects the parameters whose gradient a backward completed and hands them over per group.

    The only writer of what is collected. Runs on the thread that runs the backward hooks.

    Args:
        groups: the group of each parameter, by its index (:func:`handoff_groups`).
        hand_over: called with the indices of a group's collected parameters, in arrival order.
        flushed: called at the end of each :meth:`flush` (the end of a backward), after the last
            hand-over.
    """

    def __init__(self, groups: Sequence[int], hand_over: Callable[[List[int]], None], *,
                 flushed: Optional[Callable[[], None]] = None) -> None:
        self._flushed = flushed
        self._hand_over = hand_over
        self._collected: Dict[int, List[int]] = {}
        self._flush_queued = False
        self._set_groups(groups)
        #: How many hand-overs ran, and how many gradients were collected (for benchmarks and tests).
        self.num_handoffs = self.num_calls = 0

    def on_grad(self, index: int) -> None:
        """The parameter's gradient for this backward is complete (its hook): collected, and its
        group handed over if it was the last one."""
        self.num_calls += 1
        group = self._group_of[index]
        collected = self._collected.setdefault(group, [])
        collected.append(index)
        if not self._flush_queued:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)
                self._flush_queued = True
            except RuntimeError:  # called outside a backward (a benchmark driving the hook): at once
                self.flush()
                return
        if len(collected) == self._size[group]:
            del self._collected[group]
            self._run(collected)

    def flush(self) -> None:
        """Hands over every group collected so far (the end of a backward, or before the gradients
        are read)."""
        self._flush_queued = False
        while self._collected:
            group = next(iter(self._collected))
            self._run(self._collected.pop(group))
        if self._flushed is not None:
            self._flushed()

    def regroup(self, groups: Sequence[int]) -> None:
        """Hands over what is collected, then takes ``groups`` (each parameter's, by its index) as the
        groups from now on; the counts go on."""
        self.flush()
        self._set_groups(groups)

    def _set_groups(self, groups: Sequence[int]) -> None:
        self._group_of = list(groups)
        self._size: Dict[int, int] = {}
        for group in self._group_of:
            self._size[group] = self._size.get(group, 0) + 1

    def group_of(self, index: int) -> int:
        """The hand-off group of the parameter at ``index``."""
        return self._group_of[index]

    @property
    def groups(self) -> List[int]:
        """Each parameter's hand-off group, by position."""
        return list(self._group_of)

    @property
    def collected(self) -> int:
        """How many parameters are collected and not yet handed over."""
        return sum(len(c) for c in self._collected.values())

    def _run(self, indices: List[int]) -> None:
        self.num_handoffs += 1
        self._hand_over(indices)
