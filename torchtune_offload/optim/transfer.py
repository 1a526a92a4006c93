"""Host <-> device copies for the offload engine, the same code on every device type.

On an accelerator (CUDA, XPU, or any backend ``torch.get_device_module`` knows) host buffers are
pinned and copies run on one side stream, so they overlap with compute and with the host step.
On a CPU-only machine the "device" is the CPU itself: copies are synchronous and events are
``None``, which keeps every other line of the engine identical and testable without a GPU.
"""

from contextlib import nullcontext
from typing import Optional

import torch


class TransferEngine:
    """Copies tensors between one device and host memory.

    Args:
        device: the device holding the model's parameters.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.is_accelerator = self.device.type != "cpu"
        self._module = torch.get_device_module(self.device) if self.is_accelerator else None
        # One side stream orders every copy: a parameter's host-to-device copy after a step is
        # always finished before the next device-to-host gradient copy lands in its buffers.
        self.stream = self._module.Stream(device=self.device) if self.is_accelerator else None

    def host_empty_like(self, tensor: torch.Tensor, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """An uninitialised host tensor shaped like ``tensor`` (in ``dtype`` if given); pinned on an accelerator."""
        return torch.empty_like(tensor, dtype=dtype, device="cpu", pin_memory=self.is_accelerator)

    def _side_stream(self):
        return self._module.stream(self.stream) if self.is_accelerator else nullcontext()

    def to_host(
        self, dst: torch.Tensor, src: torch.Tensor, *, release_source: bool = False
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
        if not self.is_accelerator:
            dst.copy_(src)
            return None
        self.stream.wait_stream(self._module.current_stream(self.device))
        with self._side_stream():
            dst.copy_(src, non_blocking=True)
            event = self.stream.record_event()
        if release_source:
            src.record_stream(self.stream)
        return event

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copies host ``src`` into device ``dst`` on the side stream.

        The compute stream does not see the result until :meth:`compute_waits_for_copies`.
        """
        if not self.is_accelerator:
            dst.copy_(src)
            return
        with self._side_stream():
            dst.copy_(src, non_blocking=True)

    def compute_waits_for_copies(self) -> None:
        """Makes later work on the compute stream wait for every copy issued so far."""
        if self.is_accelerator:
            self._module.current_stream(self.device).wait_stream(self.stream)

    @staticmethod
    def wait(event: Optional[object]) -> None:
        """Blocks the host until ``event`` (from :meth:`to_host`) has completed."""
        if event is not None:
            event.synchronize()
