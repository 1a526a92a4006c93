"""The virtual device of the stream checker: CUDA's ``Stream``, ``Event`` and device-module calls
that the engine makes, each recording the ordering it gives with the checker
(``happens_before.Checker``) instead of ordering real work. See ``stream_check``."""

import contextlib
import os
import sys
import time
from typing import Any, Dict, Iterator, Optional

import torch

#: The checker's own modules, left out of the stacks it prints.
_OWN_FILES = frozenset(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
                       for name in ("stream_check.py", "happens_before.py", "virtual_device.py"))


def internal(filename: str) -> bool:
    """Whether a frame of ``filename`` is the checker's, torch's or the test runner's (left out of stacks)."""
    return (filename in _OWN_FILES or f"{os.sep}torch{os.sep}" in filename
            or any(f"{os.sep}{name}{os.sep}" in filename for name in ("_pytest", "pytest", "pluggy", "execnet", "xdist"))
            or filename.startswith("<frozen")
            or os.path.basename(filename) in ("contextlib.py", "weakref.py", "threading.py"))


def caller_site(skip: int) -> str:
    """``file:line (function)`` of the first frame outside this module and torch."""
    frame = sys._getframe(skip)
    while frame is not None and internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


class VirtualStream:
    """A stream of the virtual device: CUDA's ``Stream`` calls, with the ordering they give."""

    def __init__(self, checker: Any, agent: Any) -> None:
        self._checker = checker
        self.agent = agent

    def wait_event(self, event: "VirtualEvent") -> None:
        self._checker.stream_waits(self, event._clock)

    def wait_stream(self, stream: "VirtualStream") -> None:
        self._checker.stream_waits(self, self._checker.clock_of(stream.agent))

    def record_event(self, event: Optional["VirtualEvent"] = None) -> "VirtualEvent":
        event = event if event is not None else VirtualEvent(self._checker)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._checker.host_waits(self._checker.clock_of(self.agent))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<virtual {self.agent.name}>"


class VirtualEvent:
    """An event of the virtual device: it captures its stream's clock when recorded."""

    def __init__(self, checker: Any, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        del blocking, interprocess  # none blocks
        # Kept so that timing an event made without it fails here, as CUDA refuses it.
        self._enable_timing = enable_timing
        self._checker = checker
        self._clock: Dict[Any, int] = {}
        self._time: Optional[float] = None

    def record(self, stream: Optional[VirtualStream] = None) -> None:
        stream = stream if stream is not None else self._checker.current_stream()
        self._clock = self._checker.record(stream)
        self._time = time.perf_counter()

    def wait(self, stream: Optional[VirtualStream] = None) -> None:
        (stream if stream is not None else self._checker.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        self._checker.host_waits(self._clock)

    def query(self) -> bool:
        # Every operation has run already; a query orders nothing (as the sanitizer of torch takes it).
        return True

    def elapsed_time(self, end_event: "VirtualEvent") -> float:
        """Milliseconds between this event's record and ``end_event``'s, as CUDA's timing events give.

        Raises:
            RuntimeError: for an event made without ``enable_timing``, or not recorded (as on CUDA).
        """
        if not (self._enable_timing and end_event._enable_timing):
            raise RuntimeError("elapsed_time(): both events must be created with enable_timing=True (as CUDA requires)")
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time() of an event that was not recorded")
        return (end_event._time - self._time) * 1000


class VirtualDevice:
    """The device module of the virtual device: what ``torch.get_device_module("cuda")`` gives,
    for the calls the engine makes, plus :meth:`record_stream`."""

    def __init__(self, checker: Any) -> None:
        self._checker = checker

    def Stream(self, device: Any = None, priority: int = 0) -> VirtualStream:  # noqa: N802 (torch's name)
        del device, priority
        return self._checker.new_stream(f"stream {next(self._checker.numbers)} made at {caller_site(2)}")

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
