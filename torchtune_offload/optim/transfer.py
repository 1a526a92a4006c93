"""Host <-> device copies for the offload engine, the same code on every device type.

On an accelerator (CUDA, XPU, or any backend ``torch.get_device_module`` knows) host buffers are
pinned and copies run on two side streams, one per direction (a PCIe link copies both ways at
once), so they overlap with compute and with the host step. On a CPU-only machine the "device" is
the CPU itself: copies are synchronous and events are ``None``, which keeps every other line of the
engine identical and testable without a GPU. Inside ``stream_check.checked_streams()`` the CPU gets
virtual streams instead: every copy still completes at once, but the engine issues the waits of the
accelerator path, and a checker verifies that they order every access.

Copies may be issued from the engine's host worker threads as well as from the training thread;
the time they take is summed per direction for the engine's step timings.
"""

import threading
import time
from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import torchtune_offload.optim.stream_check as stream_check


#: What is copied: gradients down, weights up, streamed optimizer states up and down.
COPY_KINDS = ("grad", "param", "state_up", "state_down")


class TransferEngine:
    """Copies tensors between one device and host memory.

    Args:
        device: the device holding the model's parameters.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type != "cpu"
        # The streams' module: torch's on an accelerator, the virtual device while streams are
        # checked on the CPU, else None (no streams: copies are synchronous).
        self.streams = stream_check.device_module(self.device)
        # Gradients go down on one stream, weights up on the other. A weight's upload is always
        # finished before the next gradient lands in the same host buffer: the compute stream
        # waits for the upload before the next forward, and every download waits for compute.
        self.stream = self.streams.Stream(device=self.device) if self.streams is not None else None
        self.h2d_stream = self.streams.Stream(device=self.device) if self.streams is not None else None
        self._lock = threading.Lock()
        # Copy durations per kind: seconds (CPU), or timing-event pairs not yet read.
        self._seconds = dict.fromkeys(COPY_KINDS, 0.0)
        self._timed: List[Tuple[str, object, object]] = []

    def host_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor shaped like ``tensor``; pinned (by torch's allocator) on an accelerator."""
        return stream_check.host_tensor(torch.empty_like(tensor, device="cpu", pin_memory=self.is_accelerator))

    def _side_stream(self, stream=None):
        return self.streams.stream(stream or self.stream) if self.streams is not None else nullcontext()

    def _timing_event(self):
        return self.streams.Event(enable_timing=True)

    def _add_seconds(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._seconds[kind] += seconds

    def copy_seconds(self) -> Dict[str, float]:
        """Seconds spent copying since the last call, by kind (:data:`COPY_KINDS`): gradients down
        (``grad``), weights up (``param``), streamed states up and down.

        On an accelerator, copies still in flight are counted at a later call.
        """
        with self._lock:
            timed, self._timed = self._timed, []
            result, self._seconds = self._seconds, dict.fromkeys(COPY_KINDS, 0.0)
        for kind, start, end in timed:
            if end.query():
                result[kind] += start.elapsed_time(end) / 1000
            else:
                with self._lock:
                    self._timed.append((kind, start, end))
        return result

    def to_host(
        self,
        dst: torch.Tensor,
        src: torch.Tensor,
        *,
        release_source: bool = False,
    ) -> Optional[object]:
        """Copies device ``src`` into host ``dst`` without blocking the compute stream.

        Args:
            dst: host buffer.
            src: device tensor produced on the current stream.
            release_source: the caller drops ``src`` right after; keep its memory from being
                reused until the copy has read it.

        Returns:
            An event to wait on before reading ``dst``, or ``None`` when the copy is complete.
        """
        return self.to_host_many([dst], [src], release_source=release_source)

    def to_host_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *,
                     release_source: bool = False) -> Optional[object]:
        """:meth:`to_host` of each ``srcs[i]`` into ``dsts[i]``, issued together (a hand-off group's
        gradients): one wait of the download stream for the compute stream and one event for all.

        Returns:
            The event that ends the last copy, or ``None`` when the copies are complete.
        """
        if self.streams is not None:
            self.stream.wait_stream(self.streams.current_stream(self.device))
        end = self.timed_copies(dsts, srcs, kind="grad", stream=self.stream)
        if release_source and self.streams is not None:
            for src in srcs:
                self.record_stream(src, self.stream)
        return end

    def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
        """Keeps device ``tensor``'s memory from being handed out again before ``stream``'s work
        issued so far is done (``Tensor.record_stream``, on virtual streams too)."""
        stream_check.record_stream(tensor, stream)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[object]:
        """Copies host ``src`` into device ``dst`` on the upload stream; safe from any thread.

        The compute stream does not see the result until :meth:`compute_waits_for_copies` or
        :meth:`compute_waits_for` the returned event.

        Returns:
            The copy's event on an accelerator, else ``None`` (the copy is complete).
        """
        return self.timed_copy(dst, src, kind="param", stream=self.h2d_stream)

    def timed_copy(self, dst: torch.Tensor, src: torch.Tensor, *, kind: str, stream: Optional[object]) -> Optional[object]:
        """Copies ``src`` into ``dst`` on ``stream`` (an accelerator stream; ignored on a CPU-only
        machine, where the copy is synchronous), counting its time under ``kind``.

        Returns:
            The event that ends the copy on an accelerator, else ``None`` (the copy is complete).
        """
        return self.timed_copies([dst], [src], kind=kind, stream=stream)

    def timed_copies(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, kind: str,
                     stream: Optional[object]) -> Optional[object]:
        """:meth:`timed_copy` of each pair in turn, timed together (one pair of events)."""
        if self.streams is None:
            start = time.perf_counter()
            for dst, src in zip(dsts, srcs):
                dst.copy_(src)
            self._add_seconds(kind, time.perf_counter() - start)
            return None
        begin, end = self._timing_event(), self._timing_event()
        with self._side_stream(stream):
            begin.record()
            for dst, src in zip(dsts, srcs):
                dst.copy_(src, non_blocking=True)
            end.record()
        with self._lock:
            self._timed.append((kind, begin, end))
        return end

    def uploads_wait_for_compute(self) -> None:
        """Orders later uploads after the compute stream's work issued so far (device buffers it
        allocated or still reads)."""
        if self.streams is not None:
            self.h2d_stream.wait_stream(self.streams.current_stream(self.device))

    def compute_waits_for(self, event: Optional[object]) -> None:
        """Makes later work on the compute stream wait for one copy (an event from :meth:`to_device`)."""
        if event is not None:
            self.streams.current_stream(self.device).wait_event(event)

    def compute_waits_for_copies(self) -> None:
        """Makes later work on the compute stream wait for every copy issued so far."""
        if self.streams is not None:
            self.streams.current_stream(self.device).wait_stream(self.stream)
            self.streams.current_stream(self.device).wait_stream(self.h2d_stream)

    def synchronize(self) -> None:
        """Blocks the host until every copy issued so far, both ways, is complete."""
        if self.streams is not None:
            self.stream.synchronize()
            self.h2d_stream.synchronize()

    @staticmethod
    def wait(event: Optional[object]) -> None:
        """Blocks the host until ``event`` (from :meth:`to_host`) has completed."""
        if event is not None:
            event.synchronize()
