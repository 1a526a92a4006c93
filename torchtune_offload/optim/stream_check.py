"""Virtual streams for the CPU emulation, and a checker that every access to memory is ordered.

On a CPU-only machine the engine runs everything in program order, so a missing stream wait can
never change a result there, and a green CPU suite hid two races the GPU showed (a staging buffer
rewritten while a side stream still copied it). Inside :func:`checked_streams` the engine runs on
*virtual* streams instead: it creates streams and events, makes streams wait for one another,
records ``record_stream`` and synchronizes exactly as it does on CUDA, while every operation still
runs at once on the CPU (the results are the CPU emulation's, bit for bit). Meanwhile every tensor
access is checked for *happens-before*, CUDA's rules, with vector clocks:

- Each stream is an agent; so is each host thread (the training thread and each host worker).
  Work launched on a stream is ordered after the launching thread's earlier host work (a kernel
  cannot start before it is launched) and after the stream's earlier work, and after whatever the
  stream waited for (``wait_event``, ``wait_stream``). A new stream is ordered after nothing else.
- A host thread is ordered after a stream's work only by ``Event.synchronize``,
  ``Stream.synchronize``, ``synchronize()``, or a blocking read of a device value (``item()``);
  a host worker after what its submitter did before submitting, and a waiter of its future after
  the worker's work (:func:`submit`).
- Host memory is what the engine allocates as such (:func:`host_tensor`: pinned buffers, host
  copies, staging chunks) and what host code derives from it; everything else is device memory.
  An operation on host memory alone runs on the host thread, synchronously; any other runs on the
  thread's current stream (a copy between host and device memory too, as on CUDA).
- Two accesses of one storage's overlapping bytes, at least one a write, by agents neither of
  which is ordered after the other, raise :class:`StreamOrderError` naming both with their stacks.
  A device tensor freed on its allocating stream while another stream's use of it is unordered
  needs a wait or ``record_stream`` (CUDA's caching allocator would hand its memory out again).

What the checker cannot see: work that bypasses torch's dispatcher (the engine's C passes report
their accesses by hand, :func:`host_access`), ``Tensor.to("cpu")`` of a tensor already on the
CPU (no operation runs: a host read of a device value is taken as the blocking copy it is on a
GPU), and kernels that ignore torch's current stream (bitsandbytes'; the engine refuses to move
those to side streams).

Public test API: ``with checked_streams() as dev:`` yields the virtual device module (``Stream``,
``Event``, ``current_stream``, ``stream``, ``synchronize``, ``record_stream``), and the engine's
``OffloadOptimizer``, ``StateStreamer``, staging ring and overlap scheduler built inside it run on
virtual streams.
"""

import concurrent.futures
import contextlib
import threading
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from torchtune_offload.optim.happens_before import Checker, CheckingMode, Clock, StreamOrderError
from torchtune_offload.optim.virtual_device import VirtualDevice, VirtualStream

__all__ = ["StreamOrderError", "checked_streams", "device_module", "record_stream", "host_tensor", "host_work",
           "host_access", "submit", "active", "HostLock"]

# --------------------------------------------------------------------------------- public API

_ACTIVE: Optional[Checker] = None


def active() -> bool:
    """Whether :func:`checked_streams` is on."""
    return _ACTIVE is not None


@contextlib.contextmanager
def checked_streams(*, drop_waits: Sequence[Tuple[str, str]] = ()) -> Iterator[VirtualDevice]:
    """Runs the CPU emulation on virtual streams and checks that every memory access is ordered.

    Engine objects built inside (``OffloadOptimizer`` and its collaborators) issue the stream
    waits, events and ``record_stream`` calls of the GPU path; every access made meanwhile, on
    the calling thread and on the engine's host workers, is checked (see the module docs).

    Args:
        drop_waits: ``(file basename, source text)`` of wait calls to skip, for calibration tests
            that show a test fails without a given wait.

    Yields:
        The virtual device module (``Stream``, ``Event``, ``current_stream``, ``stream``,
        ``synchronize``, ``record_stream``).

    Raises:
        StreamOrderError: at the first unordered pair of accesses, naming both with their stacks.
    """
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("checked_streams() is already on; it does not nest")
    checker = Checker()
    checker.drop_waits(drop_waits)
    _ACTIVE = checker
    try:
        with CheckingMode(checker):
            yield checker.device
        checker._raise_pending()
    finally:
        _ACTIVE = None


def device_module(device: torch.device) -> Optional[Any]:
    """The module whose streams and events order work on ``device``: torch's for an accelerator,
    the virtual device on the CPU inside :func:`checked_streams`, else None (``stream_order`` then
    runs the work in program order)."""
    if device.type != "cpu":
        return torch.get_device_module(device)
    return _ACTIVE.device if _ACTIVE is not None else None


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``tensor.record_stream(stream)`` on an accelerator, or its virtual counterpart."""
    if isinstance(stream, VirtualStream):
        stream._checker.device.record_stream(tensor, stream)
    else:
        tensor.record_stream(stream)


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Marks ``tensor``'s memory as host memory (pinned buffers, host copies) while checking;
    returns it."""
    if _ACTIVE is not None:
        _ACTIVE.mark_host(tensor)
    return tensor


@contextlib.contextmanager
def host_work() -> Iterator[None]:
    """Code that runs on the host: tensors it creates from nothing (a step count) are host memory,
    as ``torch.tensor(0.0)`` is on a GPU machine."""
    checker = _ACTIVE
    if checker is None:
        yield
        return
    checker.local.host_work = getattr(checker.local, "host_work", 0) + 1
    try:
        yield
    finally:
        checker.local.host_work -= 1


def host_access(*, reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = (), what: str) -> None:
    """Reports the accesses of host code that bypasses torch's dispatcher (a C pass over data pointers)."""
    if _ACTIVE is not None:
        _ACTIVE.host_access(reads, writes, what)


class HostLock:
    """A ``threading.Lock`` that also orders, while streams are checked, whoever takes it after
    the host work of whoever released it (a mutex is a happens-before edge between host threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._released: Clock = {}

    def __enter__(self) -> "HostLock":
        self._lock.acquire()
        checker = _ACTIVE
        if checker is not None and self._released:
            checker.adopt(self._released)
        return self

    def __exit__(self, *exc: Any) -> None:
        checker = _ACTIVE
        if checker is not None:
            self._released = checker.handoff()
        self._lock.release()


class _JoiningFuture:
    """A worker's future whose ``result()`` orders the waiting thread after the worker's work."""

    def __init__(self, future: concurrent.futures.Future, clocks: Dict[str, Clock], checker: Checker) -> None:
        self._future = future
        self._clocks = clocks
        self._checker = checker

    def result(self, timeout: Optional[float] = None) -> Any:
        value = self._future.result(timeout)
        self._checker.waited_for(self._clocks["done"])
        return value

    def done(self) -> bool:
        return self._future.done()


def submit(executor: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any) -> Any:
    """``executor.submit(fn, *args)``; while checking, the worker's operations are checked too, on
    its own host agent, ordered after what the submitter did so far, and ``result()`` orders the
    waiter after the worker's work."""
    checker = _ACTIVE
    if checker is None:
        return executor.submit(fn, *args)
    clocks: Dict[str, Clock] = {"start": checker.handoff()}

    def run() -> Any:
        checker.adopt(clocks["start"])
        try:
            with CheckingMode(checker):
                return fn(*args)
        finally:
            clocks["done"] = checker.handoff()

    return _JoiningFuture(executor.submit(run), clocks, checker)
