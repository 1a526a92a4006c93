"""The memory figures an offload optimizer reports about itself."""

from dataclasses import dataclass


@dataclass
class OffloadMemoryReport:
    """Where an offload optimizer keeps its memory, in bytes.

    Attributes:
        num_offloaded: parameters stepped on the host.
        num_on_device: parameters stepped on the device (fewer than ``minimal_size`` elements).
        device_bytes_saved: optimizer state (and, with ``offload_gradients``, gradient memory) that
            lives on the host instead of the device. Zero for state not yet created by a first step.
        host_bytes: all host memory the optimizer holds: parameter copies, gradient buffers, state.
        pinned_bytes: the part of ``host_bytes`` that is page-locked (accelerators only).
    """

    num_offloaded: int
    num_on_device: int
    device_bytes_saved: int
    host_bytes: int
    pinned_bytes: int
