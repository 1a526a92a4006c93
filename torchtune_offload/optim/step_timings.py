"""Where the time of an offloaded step went: the only writer of the step-timing counters, and the
names the engine's parts take in a torch profiler's trace.

The training thread adds the seconds it blocked on host work; host steps add their own seconds
from whichever thread runs them (the training thread, or the overlap step thread), hence the lock.
"""

import contextlib
import threading
import time
from typing import ContextManager, Dict, Iterator, Optional, Protocol

import torch

#: The prefix of every range the engine names in a profiler trace (``bench/trace_summary.py`` reads them).
PROFILE_PREFIX = "offload/"


def profiled(name: str) -> ContextManager[object]:
    """A range named ``offload/<name>`` in a torch profiler's trace, on the thread that runs it.

    A step's timings say how long each part took in all; a trace says when, beside the device's
    kernels and copies, which is what finds the cause of a gap between the speed model and a run.
    The engine's host threads show only when the profiler records every thread (the recipes'
    ``profiler.all_threads``).
    """
    # These ranges sit in the backward hooks and the ring's per-chunk work: a range costs two
    # operator calls even with no profiler running (about 9 us here, some ms a step at 8B), the
    # check torch keeps for this purpose about 0.1 us.
    if not torch.autograd.profiler._is_profiler_enabled:
        return contextlib.nullcontext()
    return torch.profiler.record_function(PROFILE_PREFIX + name)


class _SumRing(Protocol):
    """What a staging ring reports of its time (``staging.py``)."""

    @property
    def waited_seconds(self) -> float: ...

    @property
    def added_seconds(self) -> float: ...


class StepTimings:
    """Counters summed since the last ``step()``, closed into one record per step."""

    def __init__(self, *, streams_states: bool = False) -> None:
        self._streams_states = streams_states
        # The staging ring whose seconds each record reports (see count_sums), and its cumulative
        # (waited, added) seconds at the last close_step: read as differences, never reset, since
        # the ring's adder thread writes them (transfer's copy_seconds resets under its own lock).
        self._ring: Optional[_SumRing] = None
        self._sums_seen = (0.0, 0.0)
        self._wait_s = 0.0
        self._host_step_s = 0.0
        self._lock = threading.Lock()
        self._last: Dict[str, float] = {}

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Counts the block as time the training thread waited (training thread only).

        Args:
            what: what it waits for, named in a profiler trace as ``offload/wait: <what>``.
        """
        start = time.perf_counter()
        try:
            with profiled(f"wait: {what}"):
                yield
        finally:
            self._wait_s += time.perf_counter() - start

    @contextlib.contextmanager
    def host_step(self, *, waited: bool) -> Iterator[None]:
        """Counts the block as host-step time, and as waiting too when the training thread ran it."""
        start = time.perf_counter()
        with profiled("host step"):
            yield
        seconds = time.perf_counter() - start
        with self._lock:
            self._host_step_s += seconds
        if waited:
            self._wait_s += seconds

    def count_sums(self, ring: _SumRing) -> None:
        """Adds to each record the growth of ``ring``'s cumulative ``waited_seconds`` and
        ``added_seconds`` since the previous one, so that a run's log shows what adding later
        micro-batches into the host sums cost, and how long it held backward up.

        Args:
            ring: the staging ring of offloaded gradients; a ring swapped in later is not seen.
        """
        self._ring = ring
        self._sums_seen = (ring.waited_seconds, ring.added_seconds)

    def close_step(self, *, started: float, copies: Dict[str, float]) -> None:
        """Ends the step that began at ``started`` (``time.perf_counter()``): the counters become
        its record and start again from zero."""
        with self._lock:
            host_step_s, self._host_step_s = self._host_step_s, 0.0
        wait_s, self._wait_s = self._wait_s, 0.0
        self._last = {
            "offload_wait_s": wait_s,
            "host_step_s": host_step_s,
            "grad_copy_s": copies["grad"],
            "param_copy_s": copies["param"],
            "offload_step_s": time.perf_counter() - started,
        }
        if self._ring is not None:
            sums = (self._ring.waited_seconds, self._ring.added_seconds)
            self._last["grad_sum_wait_s"] = sums[0] - self._sums_seen[0]
            self._last["grad_sum_add_s"] = sums[1] - self._sums_seen[1]
            self._sums_seen = sums
        if self._streams_states:
            self._last["state_upload_s"] = copies["state_up"]
            self._last["state_download_s"] = copies["state_down"]
        if host_step_s > 0:
            self._last["host_step_hidden"] = min(1.0, max(0.0, 1.0 - wait_s / host_step_s))

    def last(self) -> Dict[str, float]:
        """The previous step's record, in seconds; empty before the first step.

        ``offload_wait_s``: the training thread blocked on host work since the previous step():
        waiting for copies (clipping's wait for the gradients, before step(), included, so it may
        exceed ``offload_step_s``), running host steps itself (serial), or waiting for the host
        workers (overlap); ``host_step_s``:
        the base optimizer's steps on the host; ``grad_copy_s`` / ``param_copy_s``: gradient
        downloads and weight uploads; ``offload_step_s``: the ``step()`` call itself;
        ``host_step_hidden``: ``1 - offload_wait_s / host_step_s`` clamped to [0, 1], the share of
        the host step the training thread did not wait for. With overlap the host work of a window
        finishes during the next one, so the figures describe the steady state over steps, not
        one window. With ``update_on="device"``, ``state_upload_s`` / ``state_download_s``: the
        streamed states' copies (on an accelerator, counted once they have finished). With
        gradients offloaded, the gradient sums of the micro-batches after a window's first:
        ``grad_sum_wait_s``, the backward hooks' waits inside the staging ring (for its lock, or
        a chunk still being added; on an accelerator, time the backward stopped launching
        kernels; not in ``offload_wait_s``), and ``grad_sum_add_s``, the host cores' additions
        (the staging ring's thread; on an accelerator none when the sums are added on the
        device); additions still running when a step ends count in a later step's record (the
        last step's, in none).
        """
        return dict(self._last)
