"""The happens-before bookkeeping of the stream checker: vector clocks of every stream and host
thread, the accesses of every storage seen (by byte range), frees, and the dispatch mode that
reports each operation. See ``stream_check`` for the rules."""

import itertools
import linecache
import os
import sys
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.cuda._sanitizer import FACTORY_FUNCTION_REGEX, zip_arguments
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_iter

from torchtune_offload.optim.virtual_device import VirtualDevice, VirtualStream, internal

#: How many frames of each access's stack are kept (and printed, innermost last).
STACK_DEPTH = 14

Clock = Dict["Agent", int]


class StreamOrderError(RuntimeError):
    """Two accesses to the same memory that no stream wait, event or synchronization orders."""


# ------------------------------------------------------------------------------------ agents

class Agent:
    """A stream or a host thread: whatever runs work in its own order."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


# ---------------------------------------------------------------------------------- accesses

class _Access:
    """One read or write of a byte range by an agent, at that agent's sequence number."""

    __slots__ = ("agent", "seq", "lo", "hi", "write", "what", "stack")

    def __init__(self, agent: Agent, seq: int, lo: int, hi: int, write: bool, what: str,
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
        if not internal(frame.f_code.co_filename):
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames[::-1]


class _Storage:
    """What the checker knows of one storage: host or device memory, who allocated it, its accesses."""

    __slots__ = ("host", "allocator", "accesses", "recorded")

    def __init__(self, *, host: bool, allocator: Optional[Agent]) -> None:
        self.host = host
        self.allocator = allocator
        self.accesses: List[_Access] = []
        self.recorded: set = set()


def _byte_range(tensor: torch.Tensor) -> Tuple[int, int]:
    if tensor.numel() == 0:
        return 0, 0
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.storage_offset() * tensor.element_size()
    return start, start + extent * tensor.element_size()


def _key(tensor: torch.Tensor) -> Optional[Tuple[int, int]]:
    if tensor.device.type != "cpu":
        return None  # meta tensors (probes) hold no memory; real device memory is not emulated
    storage = tensor.untyped_storage()
    # The storage as well as the address: FSDP2 frees and re-makes its buffers by resizing their
    # storage (unseen by the dispatcher), and another storage may then take the address.
    return (storage._cdata, storage.data_ptr()) if storage.nbytes() else None


#: Operations that hand a device value to Python, so the host waits for the stream on a GPU.
_BLOCKING_READS = frozenset({"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"})


# ------------------------------------------------------------------------------------ checker

class Checker:
    """The vector clocks of every agent, and the accesses of every storage seen."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.local = threading.local()
        self.numbers = itertools.count(1)
        self.clocks: Dict[Agent, Clock] = {}
        self.storages: Dict[int, _Storage] = {}
        self.errors: List[str] = []
        self.hosts: Dict[int, Agent] = {}
        self.default_stream = self.new_stream("the default stream")
        self.device = VirtualDevice(self)
        #: ``(file basename, source text)`` of waits that tests remove to show a test sees them.
        self.dropped: List[Tuple[str, str]] = []

    # -------------------------------------------------------------------------- clocks

    def new_stream(self, name: str) -> VirtualStream:
        agent = Agent(name)
        with self.lock:
            self.clocks[agent] = {agent: 0}
        return VirtualStream(self, agent)

    def host(self) -> Agent:
        ident = threading.get_ident()
        agent = self.hosts.get(ident)
        if agent is None:
            with self.lock:
                agent = Agent(f"host thread {threading.current_thread().name!r}")
                self.hosts[ident] = agent
                self.clocks[agent] = {agent: 0}
        return agent

    def clock_of(self, agent: Agent) -> Clock:
        with self.lock:
            return dict(self.clocks[agent])

    @staticmethod
    def _join(into: Clock, other: Clock) -> None:
        for agent, seq in other.items():
            if into.get(agent, -1) < seq:
                into[agent] = seq

    def current_stream(self) -> VirtualStream:
        stream = getattr(self.local, "stream", None)
        return stream if stream is not None else self.default_stream

    def _launch(self, stream: VirtualStream) -> Clock:
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

    def stream_waits(self, stream: VirtualStream, clock: Clock) -> None:
        with self.lock:
            self._raise_pending()
            if self._is_dropped():
                return
            self._join(self._launch(stream), clock)

    def record(self, stream: VirtualStream) -> Clock:
        with self.lock:
            self._raise_pending()
            clock = self._launch(stream)
            clock[stream.agent] += 1  # the event marks a point of the stream's own order
            return dict(clock)

    def host_waits(self, clock: Clock) -> None:
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

    def handoff(self) -> Clock:
        """The calling thread's clock, for a worker that starts from it (:func:`submit`)."""
        with self.lock:
            return dict(self.clocks[self.host()])

    def adopt(self, clock: Clock) -> None:
        """The calling thread is ordered after ``clock`` (a handoff from another thread)."""
        with self.lock:
            self._join(self.clocks[self.host()], clock)

    def waited_for(self, clock: Clock) -> None:
        """The calling thread waited for a worker's future that ended at ``clock``."""
        with self.lock:
            self._raise_pending()
            if not self._is_dropped():
                self._join(self.clocks[self.host()], clock)

    # ------------------------------------------------------------------------- accesses

    def storage(self, tensor: torch.Tensor, *, allocator: Optional[Agent]) -> Optional[_Storage]:
        key = _key(tensor)
        if key is None:
            return None
        record = self.storages.get(key)
        if record is None:
            record = _Storage(host=False, allocator=allocator)
            self.storages[key] = record
            # Also forgets the record, whose address the next allocation may take.
            weakref.finalize(tensor.untyped_storage(), self._freed, key, record)
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

    def access(self, agent: Agent, clock: Clock, tensor: torch.Tensor, *, write: bool, what: str,
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
            # A wrapper subclass (FSDP2's DTensors) holds no memory of its own: the operations on
            # its local tensors are the accesses, and those the checker sees as they run.
            tensors = [t for t in tree_iter(value) if isinstance(t, torch.Tensor)
                       and not is_traceable_wrapper_subclass(t)]
            if alias is not None and alias.is_write:
                writes.extend(tensors)
            elif alias is None:
                (likes if factory else reads).extend(tensors)
        fresh = [t for ret, value in zip(schema.returns, (out,)) if ret.alias_info is None
                 for t in tree_iter(value) if isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)]
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


class CheckingMode(TorchDispatchMode):
    """Reports every operation of one thread to the checker."""

    def __init__(self, checker: Checker) -> None:
        super().__init__()
        self._checker = checker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Neither touches memory: record_stream is the allocator's bookkeeping, and the profiler's
        # ranges (the engine's offload/... names) take no tensor, so they would count as work
        # launched on the current stream and order threads that nothing orders (hiding races).
        if func is not torch.ops.aten.record_stream.default and func.namespace != "profiler":
            self._checker.on_operation(func, args, kwargs, out)
        return out
