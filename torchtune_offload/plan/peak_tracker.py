"""The tracker a traced step runs under: ``MemTracker`` keeping the step's peak, its working peak and,
for a decoder's layers, every event by the roles of the layers running (``trace.py`` extrapolates
a deep decoder's step from them)."""

from copy import deepcopy
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from torch import nn
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType

#: Events of a traced step: after each operator, the layers running (their roles: see
#: :func:`role`) and the memory alive then, by kind (``KINDS``).
Event = Tuple[FrozenSet[Any], Tuple[int, ...]]
#: Layers at each end whose events are told apart from the middle ones'.
ENDS = 2
MIDDLE = "middle"


def role(index: int, num_layers: int) -> Any:
    """What sets layer ``index`` apart: its place from either end, or none (a middle layer)."""
    if index < ENDS:
        return index
    if index >= num_layers - ENDS:
        return index - num_layers
    return MIDDLE


#: The kinds of memory MemTracker counts, in the order of its snapshots, and their total.
KINDS = (*_MemRefType, _TOTAL_KEY)
OPT, TOTAL = KINDS.index(_MemRefType.OPT), KINDS.index(_TOTAL_KEY)
#: The kinds of ``StepTrace.working_bytes``.
WORKING_KINDS = (_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH)


class PeakTracker(MemTracker):
    """``MemTracker`` keeping only the step's overall peak, which is all the planner reads, and,
    given the decoder's ``layers``, every event (:data:`Event`) for ``trace.py``'s extrapolation.

    ``MemTracker`` also keeps each module's own peak: at every operator it passes over every
    module seen so far, so a trace costs operators x modules. LoRA's adapters triple the modules of
    a model: planning llama3_2 1B LoRA took 75 s against 33 s for the full fine-tune, and Llama 3.1
    8B LoRA did not finish a variant in 9 minutes. The overall peak is updated exactly as
    ``MemTracker`` updates it.
    """

    def __init__(self, *, layers: Optional[List[nn.Module]] = None):
        super().__init__()
        self._layers = layers
        self._roles: Optional[Dict[str, Any]] = None
        self._before = 0
        self.events: List[Event] = []
        #: Operators dispatched so far, counted as ``plan/launch.py`` counts them.
        self.ops = 0
        #: The most working memory alive so far (``StepTrace.working_bytes``).
        self.working_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if self._layers is not None:
            self._before = self._total()
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state) -> None:
        del peak_state  # a module-level state; no module peaks are kept
        for dev, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[dev] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(snapshot)
            self.working_peak = max(self.working_peak, sum(snapshot.get(k, 0) for k in WORKING_KINDS))
        # After an operator that allocates nothing (a device query, a scalar read: torch's AdamW
        # makes some per parameter, so their number grows with the layers) no more is alive than
        # at the event before it, at any number of layers: it cannot be the peak, and leaving it
        # out lines up the events of traces with different numbers of layers.
        if self._layers is not None and (self._total() != self._before or not self.events):
            snapshot = next(iter(self._curr_mem_snap.values()), {})
            self.events.append((self._running(), tuple(snapshot.get(k, 0) for k in KINDS)))

    def now(self) -> Tuple[int, ...]:
        """What is alive now, by kind (``KINDS``)."""
        snapshot = next(iter(self._curr_mem_snap.values()), {})
        return tuple(int(snapshot.get(k, 0)) for k in KINDS)

    def peak(self) -> Tuple[int, ...]:
        """What was alive at the peak so far, by kind (``KINDS``)."""
        snapshot = next(iter(self._peak_mem_snap.values()), {})
        return tuple(int(snapshot.get(k, 0)) for k in KINDS)

    def _total(self) -> int:
        # Fake tensors are all on one device (the CPU).
        return sum(snapshot[_TOTAL_KEY] for snapshot in self._curr_mem_snap.values())

    def _running(self) -> FrozenSet[Any]:
        """The roles of the layers running now (``ModTracker`` names them once the model runs)."""
        if self._roles is None:
            names = [self._mod_tracker.get_known_fqn(layer) for layer in self._layers]
            if None in names:
                return frozenset()
            self._roles = {name: role(i, len(names)) for i, name in enumerate(names)}
        return frozenset(self._roles[n] for n in self._mod_tracker.parents if n in self._roles)


class NoHook:
    """A hook handle with nothing to remove."""

    def remove(self) -> None:
        pass
