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
import itertools
import linecache
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.cuda._sanitizer import FACTORY_FUNCTION_REGEX, zip_arguments
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter

__all__ = ["StreamOrderError", "checked_streams", "device_module", "record_stream", "host_tensor", "host_work",
           "host_access", "submit", "active", "HostLock"]

#: How many frames of each access's stack are kept (and printed, innermost last).
STACK_DEPTH = 14

_Clock = Dict["_Agent", int]


class StreamOrderError(RuntimeError):
    """Two accesses to the same memory that no stream wait, event or synchronization orders."""


# ------------------------------------------------------------------------------------ agents

class _Agent:
    """A stream or a host thread: whatever runs work in its own order."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def _caller_site(skip: int) -> str:
    """``file:line (function)`` of the first frame outside this module and torch."""
    frame = sys._getframe(skip)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _internal(filename: str) -> bool:
    return (filename == __file__ or f"{os.sep}torch{os.sep}" in filename
            or any(f"{os.sep}{name}{os.sep}" in filename for name in ("_pytest", "pytest", "pluggy", "execnet", "xdist"))
            or filename.startswith("<frozen")
            or os.path.basename(filename) in ("contextlib.py", "weakref.py", "threading.py"))


class VirtualStream:
    """A stream of the virtual device: CUDA's ``Stream`` calls, with the ordering they give."""

    def __init__(self, checker: "_Checker", agent: _Agent) -> None:
        self._checker = checker
        self.agent = agent

    def wait_event(self, event: "VirtualEvent") -> None:
        self._checker.stream_waits(self, event._clock, what="wait_event")

    def wait_stream(self, stream: "VirtualStream") -> None:
        self._checker.stream_waits(self, self._checker.clock_of(stream.agent), what="wait_stream")

    def record_event(self, event: Optional["VirtualEvent"] = None) -> "VirtualEvent":
        event = event if event is not None else VirtualEvent(self._checker)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._checker.host_waits(self._checker.clock_of(self.agent), what="Stream.synchronize")

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<virtual {self.agent.name}>"


class VirtualEvent:
    """An event of the virtual device: it captures its stream's clock when recorded."""

    def __init__(self, checker: "_Checker", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        del enable_timing, blocking, interprocess  # every virtual event can time; none blocks
        self._checker = checker
        self._clock: _Clock = {}
        self._time: Optional[float] = None

    def record(self, stream: Optional[VirtualStream] = None) -> None:
        stream = stream if stream is not None else self._checker.current_stream()
        self._clock = self._checker.record(stream)
        self._time = time.perf_counter()

    def wait(self, stream: Optional[VirtualStream] = None) -> None:
        (stream if stream is not None else self._checker.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self._checker.host_waits(self._clock, what="Event.synchronize")

    def query(self) -> bool:
        # Every operation has run already; a query orders nothing (as the sanitizer of torch takes it).
        return True

    def elapsed_time(self, end: "VirtualEvent") -> float:
        """Milliseconds between this event's record and ``end``'s, as CUDA's timing events give."""
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time() of an event that was not recorded")
        return (end._time - self._time) * 1000


class VirtualDevice:
    """The device module of the virtual device: what ``torch.get_device_module("cuda")`` gives,
    for the calls the engine makes, plus :meth:`record_stream`."""

    def __init__(self, checker: "_Checker") -> None:
        self._checker = checker

    def Stream(self, device: Any = None, priority: int = 0) -> VirtualStream:  # noqa: N802 (torch's name)
        del device, priority
        return self._checker.new_stream(f"stream {next(self._checker.numbers)} made at {_caller_site(2)}")

    def Event(self, enable_timing: bool = False, blocking: bool = False,  # noqa: N802 (torch's name)
              interprocess: bool = False) -> VirtualEvent:
        return VirtualEvent(self._checker, enable_timing, blocking, interprocess)

    def current_stream(self, device: Any = None) -> VirtualStream:
        del device
        return self._checker.current_stream()

    def default_stream(self, device: Any = None) -> VirtualStream:
        del device
        return self._checker.default_stream

    @contextlib.contextmanager
    def stream(self, stream: Optional[VirtualStream]) -> Iterator[None]:
        """Makes ``stream`` the calling thread's current stream (None: leaves it)."""
        if stream is None:
            yield
            return
        local = self._checker.local
        previous = getattr(local, "stream", None)
        local.stream = stream
        try:
            yield
        finally:
            local.stream = previous

    def synchronize(self, device: Any = None) -> None:
        del device
        self._checker.synchronize_all()

    def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
        """``tensor.record_stream(stream)``: the memory is not handed out again before ``stream``'s
        work issued so far is done."""
        self._checker.record_stream(tensor, stream)


# ---------------------------------------------------------------------------------- accesses

class _Access:
    """One read or write of a byte range by an agent, at that agent's sequence number."""

    __slots__ = ("agent", "seq", "lo", "hi", "write", "what", "stack")

    def __init__(self, agent: _Agent, seq: int, lo: int, hi: int, write: bool, what: str,
                 stack: List[Tuple[str, int, str]]) -> None:
        self.agent, self.seq, self.lo, self.hi = agent, seq, lo, hi
        self.write, self.what, self.stack = write, what, stack

    def describe(self) -> str:
        lines = [f"{'write' if self.write else 'read'} of bytes [{self.lo}, {self.hi}) by {self.agent.name}, "
                 f"in {self.what}, at:"]
        for filename, lineno, name in self.stack:
            source = linecache.getline(filename, lineno).strip()
            lines.append(f'      File "{filename}", line {lineno}, in {name}' + (f"\n        {source}" if source else ""))
        return "\n".join(lines)


def _stack() -> List[Tuple[str, int, str]]:
    frames, frame = [], sys._getframe(2)
    while frame is not None and len(frames) < STACK_DEPTH:
        if not _internal(frame.f_code.co_filename):
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


class _Storage:
    """What the checker knows of one storage: host or device memory, who allocated it, its accesses."""

    __slots__ = ("host", "allocator", "accesses", "recorded", "finalizer")

    def __init__(self, *, host: bool, allocator: Optional[_Agent]) -> None:
        self.host = host
        self.allocator = allocator
        self.accesses: List[_Access] = []
        self.recorded: set = set()
        self.finalizer = None


def _byte_range(tensor: torch.Tensor) -> Tuple[int, int]:
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + extent * tensor.element_size()


def _key(tensor: torch.Tensor) -> Optional[int]:
    if tensor.device.type != "cpu":
        return None  # meta tensors (probes) hold no memory; real device memory is not emulated
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


#: Operations that hand a device value to Python, so the host waits for the stream on a GPU.
_BLOCKING_READS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"})


# ------------------------------------------------------------------------------------ checker

class _Checker:
    """The vector clocks of every agent, and the accesses of every storage seen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.local = threading.local()
        self.numbers = itertools.count(1)
        self.clocks: Dict[_Agent, _Clock] = {}
        self.storages: Dict[int, _Storage] = {}
        self.errors: List[str] = []
        self.hosts: Dict[int, _Agent] = {}
        self.default_stream = self.new_stream("the default stream")
        self.device = VirtualDevice(self)
        #: ``(file basename, source text)`` of waits that tests remove to show a test sees them.
        self.dropped: List[Tuple[str, str]] = []

    # -------------------------------------------------------------------------- clocks

    def new_stream(self, name: str) -> VirtualStream:
        agent = _Agent(name)
        with self.lock:
            self.clocks[agent] = {agent: 0}
        return VirtualStream(self, agent)

    def host(self) -> _Agent:
        ident = threading.get_ident()
        agent = self.hosts.get(ident)
        if agent is None:
            with self.lock:
                agent = _Agent(f"host thread {threading.current_thread().name!r}")
                self.hosts[ident] = agent
                self.clocks[agent] = {agent: 0}
        return agent

    def clock_of(self, agent: _Agent) -> _Clock:
        with self.lock:
            return dict(self.clocks[agent])

    @staticmethod
    def _join(into: _Clock, other: _Clock) -> None:
        for agent, seq in other.items():
            if into.get(agent, -1) < seq:
                into[agent] = seq

    def current_stream(self) -> VirtualStream:
        stream = getattr(self.local, "stream", None)
        return stream if stream is not None else self.default_stream

    def _launch(self, stream: VirtualStream) -> _Clock:
        """The stream's clock once the calling thread launched work on it."""
        clock = self.clocks[stream.agent]
        self._join(clock, self.clocks[self.host()])
        return clock

    def _is_dropped(self) -> bool:
        """Whether the wait being made is one a test removed (see :meth:`drop_waits`)."""
        if not self.dropped:
            return False
        frame = sys._getframe(3)
        for _ in range(6):
            if frame is None:
                break
            name = os.path.basename(frame.f_code.co_filename)
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
            if any(name == file and text in line for file, text in self.dropped):
                return True
            frame = frame.f_back
        return False

    def stream_waits(self, stream: VirtualStream, clock: _Clock, *, what: str) -> None:
        with self.lock:
            self._raise_pending()
            if self._is_dropped():
                return
            self._join(self._launch(stream), clock)

    def record(self, stream: VirtualStream) -> _Clock:
        with self.lock:
            self._raise_pending()
            clock = self._launch(stream)
            clock[stream.agent] += 1  # the event marks a point of the stream's own order
            return dict(clock)

    def host_waits(self, clock: _Clock, *, what: str) -> None:
        with self.lock:
            self._raise_pending()
            if self._is_dropped():
                return
            self._join(self.clocks[self.host()], clock)

    def synchronize_all(self) -> None:
        with self.lock:
            self._raise_pending()
            if self._is_dropped():
                return
            host = self.clocks[self.host()]
            for agent, clock in list(self.clocks.items()):
                if agent not in self.hosts.values():
                    self._join(host, clock)

    def handoff(self) -> _Clock:
        """The calling thread's clock, for a worker that starts from it (:func:`submit`)."""
        with self.lock:
            return dict(self.clocks[self.host()])

    def adopt(self, clock: _Clock) -> None:
        """The calling thread is ordered after ``clock`` (a handoff from another thread)."""
        with self.lock:
            self._join(self.clocks[self.host()], clock)

    def waited_for(self, clock: _Clock) -> None:
        """The calling thread waited for a worker's future that ended at ``clock``."""
        with self.lock:
            self._raise_pending()
            if not self._is_dropped():
                self._join(self.clocks[self.host()], clock)

    # ------------------------------------------------------------------------- accesses

    def storage(self, tensor: torch.Tensor, *, allocator: Optional[_Agent]) -> Optional[_Storage]:
        key = _key(tensor)
        if key is None:
            return None
        record = self.storages.get(key)
        if record is None:
            record = _Storage(host=False, allocator=allocator)
            self.storages[key] = record
            # Also forgets the record, whose address the next allocation may take.
            record.finalizer = weakref.finalize(tensor.untyped_storage(), self._freed, key, record)
        return record

    def mark_host(self, tensor: torch.Tensor) -> None:
        with self.lock:
            record = self.storage(tensor, allocator=None)
            if record is not None:
                # Just allocated: its creation was the host's, not a stream's.
                record.host = True
                record.accesses = []

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory; memory first seen now is host memory inside
        :func:`host_work` (``torch.tensor([...])`` builds it outside the dispatcher) or when it is a
        scalar, else device memory."""
        key = _key(tensor)
        if key is None:
            return False
        record = self.storages.get(key)
        if record is None:
            record = self.storage(tensor, allocator=None)
            # A scalar made outside any operation (torch.tensor(0.0): a step count) is host memory
            # on a GPU machine too.
            record.host = bool(getattr(self.local, "host_work", 0)) or tensor.dim() == 0
        return record.host

    def access(self, agent: _Agent, clock: _Clock, tensor: torch.Tensor, *, write: bool, what: str,
               stack: List[Tuple[str, int, str]]) -> None:
        """Checks one access by ``agent`` (whose clock is ``clock``, already advanced) and keeps it."""
        record = self.storage(tensor, allocator=None)
        if record is None:
            return
        lo, hi = _byte_range(tensor)
        if lo == hi:
            return
        new = _Access(agent, clock[agent], lo, hi, write, what, stack)
        kept = []
        for old in record.accesses:
            overlaps = old.lo < hi and lo < old.hi
            if overlaps and (old.write or write) and old.agent is not agent and clock.get(old.agent, -1) < old.seq:
                raise StreamOrderError(
                    "unordered accesses to the same memory: neither is ordered after the other by a "
                    "stream wait, an event or a synchronization.\n"
                    f"  earlier {old.describe()}\n  later {new.describe()}"
                )
            covered = overlaps and lo <= old.lo and old.hi <= hi
            if covered and (write or (old.agent is agent and not old.write)):
                continue  # the new access orders whoever comes after it after this one too
            kept.append(old)
        kept.append(new)
        record.accesses = kept

    def record_stream(self, tensor: torch.Tensor, stream: VirtualStream) -> None:
        with self.lock:
            self._raise_pending()
            if self._is_dropped():
                return
            record = self.storage(tensor, allocator=None)
            if record is not None:
                record.recorded.add(stream.agent)

    def _freed(self, key: int, record: _Storage) -> None:
        """A device storage died: CUDA's allocator hands it out again on its allocating stream now."""
        with self.lock:
            if self.storages.get(key) is record:
                del self.storages[key]
            if record.host or record.allocator is None:
                return  # pinned host memory is reused only after its copies' events; unknown: not checked
            free = dict(self.clocks[record.allocator])
            host = self.hosts.get(threading.get_ident())
            if host is not None:
                self._join(free, self.clocks[host])
            for old in record.accesses:
                if old.agent is record.allocator or old.agent in record.recorded:
                    continue
                if old.agent in self.hosts.values() or free.get(old.agent, -1) >= old.seq:
                    continue
                self.errors.append(
                    f"device memory freed while another stream's use of it is unordered: it was allocated on "
                    f"{record.allocator.name}, which never waited for the {'write' if old.write else 'read'} below, "
                    f"and record_stream({old.agent.name}) was not called.\n  unordered {old.describe()}\n"
                    "  freed at:\n" + ("\n".join(f'      File "{f}", line {n}, in {fn}' for f, n, fn in _stack())
                                       or "      (no frame of the program: at the end of a test, or by the garbage collector)")
                )
                break

    def _raise_pending(self) -> None:
        if self.errors:
            errors, self.errors = self.errors, []
            raise StreamOrderError("\n".join(errors))

    # ------------------------------------------------------------------------ operations

    def on_operation(self, func: Any, args: Sequence[Any], kwargs: Dict[str, Any], out: Any) -> None:
        schema = func._schema
        factory = bool(FACTORY_FUNCTION_REGEX.match(schema.name))
        reads: List[torch.Tensor] = []
        writes: List[torch.Tensor] = []
        likes: List[torch.Tensor] = []  # a factory's templates: their memory is not read
        for argument, value in zip_arguments(schema, args, kwargs):
            alias = argument.alias_info
            tensors = [t for t in tree_iter(value) if isinstance(t, torch.Tensor)]
            if alias is not None and alias.is_write:
                writes.extend(tensors)
            elif alias is None:
                (likes if factory else reads).extend(tensors)
        fresh = [t for ret, value in zip(schema.returns, (out,)) if ret.alias_info is None
                 for t in tree_iter(value) if isinstance(t, torch.Tensor)]
        stack = _stack()
        with self.lock:
            self._raise_pending()
            host_agent = self.host()
            inputs = reads + writes
            large = [t for t in inputs if t.dim() > 0]
            if inputs:
                on_host = all(self.is_host(t) for t in large) and any(self.is_host(t) for t in inputs)
            elif likes:
                on_host = all(self.is_host(t) for t in likes)
            else:
                on_host = bool(getattr(self.local, "host_work", 0))
            if on_host:
                agent = host_agent
                clock = self.clocks[agent]
                if any(not self.is_host(t) for t in inputs):
                    # A host operation on a device value: on a GPU the value came by a blocking copy.
                    self._join(clock, self.clocks[self.current_stream().agent])
            else:
                agent = self.current_stream().agent
                clock = self._launch(self.current_stream())
            clock[agent] += 1
            what = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
            for tensor in reads:
                self.access(agent, clock, tensor, write=False, what=what, stack=stack)
            for tensor in writes:
                self.access(agent, clock, tensor, write=True, what=what, stack=stack)
            for tensor in fresh:
                key = _key(tensor)
                if key is None:
                    continue
                if key not in self.storages:
                    record = self.storage(tensor, allocator=None if on_host else agent)
                    record.host = on_host
                self.access(agent, clock, tensor, write=True, what=what, stack=stack)
            # A copy between host and device memory without non_blocking blocks the host (a copy
            # between two device tensors never does).
            blocking_copy = (schema.name == "aten::copy_" and self.is_host(args[0]) != self.is_host(args[1])
                             and not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
            if not on_host and (schema.name in _BLOCKING_READS or blocking_copy):
                # item(), equal() (a Python value) and a copy without non_blocking: the host
                # blocks until the stream is done.
                self._join(self.clocks[host_agent], clock)

    def host_access(self, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor], what: str) -> None:
        stack = _stack()
        with self.lock:
            self._raise_pending()
            agent = self.host()
            clock = self.clocks[agent]
            if any(not self.is_host(t) for t in [*reads, *writes]):
                # Device values (a test calling the pass itself): on a GPU they came by a blocking copy.
                self._join(clock, self.clocks[self.current_stream().agent])
            clock[agent] += 1
            for tensor in reads:
                self.access(agent, clock, tensor, write=False, what=what, stack=stack)
            for tensor in writes:
                self.access(agent, clock, tensor, write=True, what=what, stack=stack)

    def drop_waits(self, sites: Sequence[Tuple[str, str]]) -> None:
        """Makes the waits made from the given ``(file basename, source text)`` lines do nothing
        (a calibration: a test shows that some test fails without each wait)."""
        self.dropped.extend(sites)


class _Mode(TorchDispatchMode):
    """Reports every operation of one thread to the checker."""

    def __init__(self, checker: _Checker) -> None:
        super().__init__()
        self._checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not torch.ops.aten.record_stream.default:
            self._checker.on_operation(func, args, kwargs, out)
        return out


# --------------------------------------------------------------------------------- public API

_ACTIVE: Optional[_Checker] = None


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
    checker = _Checker()
    checker.drop_waits(drop_waits)
    _ACTIVE = checker
    try:
        with _Mode(checker):
            yield checker.device
        checker._raise_pending()
    finally:
        _ACTIVE = None


def device_module(device: torch.device) -> Optional[Any]:
    """The module whose streams and events order work on ``device``: torch's for an accelerator,
    the virtual device on the CPU inside :func:`checked_streams`, else None (no streams: every
    copy completes at once)."""
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
        self._released: _Clock = {}

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

    def __init__(self, future: concurrent.futures.Future, clocks: Dict[str, _Clock], checker: _Checker) -> None:
        self._future = future
        self._clocks = clocks
        self._checker = checker

    def result(self, timeout: Optional[float] = None) -> Any:
        value = self._future.result(timeout)
        self._checker.waited_for(self._clocks["done"])
        return value

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        return self._future.exception(timeout)


def submit(executor: concurrent.futures.Executor, fn: Callable[..., Any], *args: Any) -> Any:
    """``executor.submit(fn, *args)``; while checking, the worker's operations are checked too, on
    its own host agent, ordered after what the submitter did so far, and ``result()`` orders the
    waiter after the worker's work."""
    checker = _ACTIVE
    if checker is None:
        return executor.submit(fn, *args)
    clocks: Dict[str, _Clock] = {"start": checker.handoff()}

    def run() -> Any:
        checker.adopt(clocks["start"])
        try:
            with _Mode(checker):
                return fn(*args)
        finally:
            clocks["done"] = checker.handoff()

    return _JoiningFuture(executor.submit(run), clocks, checker)
