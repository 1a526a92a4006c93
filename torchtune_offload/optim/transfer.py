"""Host <-> device copies for the offload engine, the same code on every device type.

On an accelerator (CUDA, XPU, or any backend ``torch.get_device_module`` knows) host buffers are
pinned and copies run on two side streams, one per direction (a PCIe link copies both ways at
once), so they overlap with compute and with the host step. On a CPU-only machine the "device" is
the CPU itself and the streams are :class:`~torchtune_offload.optim.stream_order.StreamOrder`'s
stand-in: every copy is complete when it returns, and the engine's other lines are the
accelerator's. Inside ``stream_check.checked_streams()`` the streams are virtual: copies still
complete at once, and a checker verifies that the waits order every access.

Copies may be issued from the engine's host worker threads as well as from the training thread;
the time they take is summed per direction for the engine's step timings.
"""

import threading
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.stream_order import StreamOrder


#: What is copied: gradients down, weights up, streamed optimizer states up and down.
COPY_KINDS = ("grad", "param", "state_up", "state_down")


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i], non_blocking=True)`` for each i, on the current stream, launched as
    one operation (``torch._foreach_copy_``: the copies of ``copy_``, one dispatch) where there are several."""
    if len(dsts) == 1:
        dsts[0].copy_(srcs[0], non_blocking=True)
    else:
        torch._foreach_copy_(list(dsts), list(srcs), non_blocking=True)


class TransferEngine:
    """Copies tensors between one device and host memory.

    Args:
        device: the device holding the model's parameters.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type != "cpu"
        #: The engine's one owner of streams, events and waits (shared by its rings and streamer).
        self.order = StreamOrder(self.device)
        # Gradients go down on one stream, weights up on the other. A weight's upload is always
        # finished before the next gradient lands in the same host buffer: the compute stream
        # waits for the upload before the next forward, and every download waits for compute.
        self.stream = self.order.new_stream()
        self.h2d_stream = self.order.new_stream()
        self._lock = threading.Lock()
        # Copy durations per kind: timing-event pairs not yet read.
        self._timed: List[Tuple[str, object, object]] = []

    def host_empty_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """An uninitialised host tensor shaped like ``tensor``; pinned (by torch's allocator) on an accelerator."""
        return stream_check.host_tensor(torch.empty_like(tensor, device="cpu", pin_memory=self.is_accelerator))

    def copy_seconds(self) -> Dict[str, float]:
        """Seconds spent copying since the last call, by kind (:data:`COPY_KINDS`): gradients down
        (``grad``), weights up (``param``), streamed states up and down.

        On an accelerator, copies still in flight are counted at a later call.
        """
        with self._lock:
            timed, self._timed = self._timed, []
        result = dict.fromkeys(COPY_KINDS, 0.0)
        for kind, start, end in timed:
            if self.order.done(end):
                result[kind] += self.order.elapsed_ms(start, end) / 1000
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
    ) -> object:
        """Copies device ``src`` into host ``dst`` without blocking the compute stream.

        Args:
            dst: host buffer.
            src: device tensor produced on the current stream.
            release_source: the caller drops ``src`` right after; keep its memory from being
                reused until the copy has read it.

        Returns:
            An event to wait on (:meth:`wait`) before reading ``dst``.
        """
        return self.to_host_many([dst], [src], release_source=release_source)

    def to_host_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *,
                     release_source: bool = False) -> object:
        """:meth:`to_host` of each ``srcs[i]`` into ``dsts[i]``, issued together (a hand-off group's
        gradients): one wait of the download stream for the compute stream and one event for all.

        Returns:
            The event that ends the last copy.
        """
        self.order.wait_stream(self.stream, self.order.current())
        end = self.timed_copies(dsts, srcs, kind="grad", stream=self.stream)
        for src in srcs if release_source else ():
            self.order.keep_for(src, self.stream)
        return end

    def to_device_many(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> object:
        """Copies each host ``srcs[i]`` into device ``dsts[i]`` on the upload stream, in one launch;
        safe from any thread.

        The compute stream does not see the result until :meth:`compute_waits_for_copies` or
        :meth:`compute_waits_for` the returned event.

        Returns:
            The event that ends the copies.
        """
        return self.timed_copies(dsts, srcs, kind="param", stream=self.h2d_stream)

    def timed_copies(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], *, kind: str,
                     stream: object) -> object:
        """Copies each ``srcs[i]`` into ``dsts[i]`` on ``stream``, in one launch (:func:`copy_all`),
        their time counted together under ``kind``.

        Returns:
            The event that ends the copies.
        """
        order = self.order
        with order.on(stream):
            begin = order.record(stream, timing=True)
            if dsts:
                copy_all(dsts, srcs)
            end = order.record(stream, timing=True)
        with self._lock:
            self._timed.append((kind, begin, end))
        return end

    def uploads_wait_for_compute(self) -> None:
        """Orders later uploads after the compute stream's work issued so far (device buffers it
        allocated or still reads)."""
        self.order.wait_stream(self.h2d_stream, self.order.current())

    def compute_waits_for(self, event: Optional[object]) -> None:
        """Makes later work on the compute stream wait for one copy (an event from :meth:`to_device_many`;
        None: nothing)."""
        self.order.wait_event(self.order.current(), event)

    def compute_waits_for_copies(self) -> None:
        """Makes later work on the compute stream wait for every copy issued so far."""
        compute = self.order.current()
        self.order.wait_stream(compute, self.stream)
        self.order.wait_stream(compute, self.h2d_stream)

    def synchronize(self) -> None:
        """Blocks the host until every copy issued so far, both ways, is complete."""
        self.order.host_waits_stream(self.stream)
        self.order.host_waits_stream(self.h2d_stream)

    def wait(self, event: Optional[object]) -> None:
        """Blocks the host until ``event`` (from :meth:`to_host`) has completed."""
        self.order.host_waits(event)
