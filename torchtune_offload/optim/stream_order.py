"""The one owner of the engine's stream ordering: every stream, event, wait and ``record_stream``.

The engine's copies, staging rings and streamed updates order their work only through a
:class:`StreamOrder`. It drives one of three device modules, chosen once from the device:

- an accelerator's own (``torch.get_device_module``: CUDA, XPU, ...), where work is queued and
  the waits are what keep it correct;
- the stream checker's virtual device, on the CPU inside ``stream_check.checked_streams()``:
  every operation runs at once, and each wait is recorded and checked;
- :class:`InOrderDevice`, on the CPU otherwise: a stand-in whose streams run their work in program
  order as it is issued, so every wait is already satisfied and costs a call.

So the engine's ordering code is one path on every machine, and the checker checks the very calls
a GPU makes.
"""

import contextlib
import time
from typing import Any, Optional

import torch

import torchtune_offload.optim.stream_check as stream_check

__all__ = ["InOrderDevice", "InOrderEvent", "InOrderStream", "StreamOrder"]


class InOrderStream:
    """A stream of :class:`InOrderDevice`: its work is done when issued, so it waits for nothing."""

    def wait_event(self, event: "InOrderEvent") -> None:
        del event  # already complete

    def wait_stream(self, stream: "InOrderStream") -> None:
        del stream  # already complete

    def synchronize(self) -> None:
        """Nothing is in flight."""

    def query(self) -> bool:
        return True


class InOrderEvent:
    """An event of :class:`InOrderDevice`: complete when recorded; it keeps the time it was recorded
    at, so that copies are timed as an accelerator's timing events time them.

    Args:
        enable_timing: whether :meth:`elapsed_time` may read it (as CUDA requires).
    """

    def __init__(self, enable_timing: bool = False) -> None:
        self._enable_timing = enable_timing
        self._time: Optional[float] = None

    def record(self, stream: Optional[InOrderStream] = None) -> None:
        del stream
        if self._enable_timing:
            self._time = time.perf_counter()

    def synchronize(self) -> None:
        """Complete since it was recorded."""

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: "InOrderEvent") -> float:
        """Milliseconds between this event's record and ``end_event``'s.

        Raises:
            RuntimeError: for an event made without ``enable_timing`` or not recorded (as on CUDA).
        """
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time() needs two recorded events made with enable_timing=True")
        return (end_event._time - self._time) * 1000


class InOrderDevice:
    """The device module of a CPU without the stream checker: the calls the engine makes of
    ``torch.cuda``, each a no-op because work runs in program order."""

    def __init__(self) -> None:
        self._current = InOrderStream()

    def Stream(self, device: Any = None, priority: int = 0) -> InOrderStream:  # noqa: N802 (torch's name)
        del device, priority
        return InOrderStream()

    def Event(self, enable_timing: bool = False) -> InOrderEvent:  # noqa: N802 (torch's name)
        return InOrderEvent(enable_timing)

    def current_stream(self, device: Any = None) -> InOrderStream:
        del device
        return self._current

    def stream(self, stream: Optional[InOrderStream]) -> contextlib.AbstractContextManager:
        del stream
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: InOrderStream) -> None:
        del tensor, stream  # memory is never reused before the work that reads it, which is done


class StreamOrder:
    """Streams, events, waits and ``record_stream`` for one device (see the module docs).

    Args:
        device: the device holding the model's parameters.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        module = stream_check.device_module(self.device)
        #: Whether work runs in program order (a CPU without the checker): copies are complete on return.
        self.in_order = module is None
        self._module = InOrderDevice() if module is None else module

    def new_stream(self) -> Any:
        """A new side stream, ordered after nothing."""
        return self._module.Stream(device=self.device)

    def current(self) -> Any:
        """The calling thread's current (compute) stream."""
        return self._module.current_stream(self.device)

    def on(self, stream: Any) -> contextlib.AbstractContextManager:
        """Makes ``stream`` the calling thread's current stream inside the ``with`` block."""
        return self._module.stream(stream)

    def record(self, stream: Any = None, *, timing: bool = False) -> Any:
        """An event at the end of the work issued so far on ``stream`` (the current stream if None).

        Args:
            stream: the stream.
            timing: make it a timing event (:meth:`elapsed_ms`).
        """
        event = self._module.Event(enable_timing=timing)
        event.record(stream)  # None: the current stream, as torch's record takes it
        return event

    @staticmethod
    def wait_event(stream: Any, event: Optional[Any]) -> None:
        """Makes later work on ``stream`` wait for ``event`` (nothing if ``event`` is None: no work
        to wait for has been issued yet)."""
        if event is not None:
            stream.wait_event(event)

    @staticmethod
    def wait_stream(stream: Any, other: Any) -> None:
        """Makes later work on ``stream`` wait for the work issued so far on ``other``."""
        stream.wait_stream(other)

    def keep_for(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor.record_stream(stream)``: the memory is not handed out again before ``stream``'s
        work issued so far is done."""
        if self.in_order:
            return
        stream_check.record_stream(tensor, stream)

    @staticmethod
    def host_waits(event: Optional[Any]) -> None:
        """Blocks the host until ``event`` is complete (nothing if None)."""
        if event is not None:
            event.synchronize()

    @staticmethod
    def host_waits_stream(stream: Any) -> None:
        """Blocks the host until the work issued so far on ``stream`` is complete."""
        stream.synchronize()

    @staticmethod
    def done(event: Any) -> bool:
        """Whether ``event``'s work is complete, without waiting."""
        return event.query()

    @staticmethod
    def elapsed_ms(start: Any, end: Any) -> float:
        """Milliseconds between two timing events' records."""
        return start.elapsed_time(end)
