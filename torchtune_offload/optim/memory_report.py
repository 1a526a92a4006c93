"""The memory figures an offload optimizer reports about itself."""

from dataclasses import dataclass
from typing import Union

import torch

from torchtune_offload.optim.host_arena import NONE, buffer_bytes, pinned_allocation_bytes
from torchtune_offload.optim.param_table import ParameterTable
from torchtune_offload.optim.staging import DeviceSumRing, StagingRing
from torchtune_offload.optim.state_streamer import StateStreamer


@dataclass
class OffloadMemoryReport:
    """Where an offload optimizer keeps its memory, in bytes.

    Attributes:
        num_offloaded: parameters whose optimizer state lives on the host (stepped on the host, or
            with ``update_on="device"`` streamed to the device's update).
        num_on_device: parameters stepped on the device with their state there (fewer than
            ``minimal_size`` elements).
        device_bytes_saved: optimizer state (and, with the gradients offloaded, gradient memory) that
            lives on the host instead of the device. Zero for state not yet created by a first step.
        host_bytes: all host memory the optimizer holds: parameter copies, gradient buffers, state.
        pinned_bytes: the part of ``host_bytes`` that is page-locked (accelerators only).
        device_staging_bytes: device memory the engine stages through. ``update_on="device"``:
            the buffers that stage streamed states, at most ``device_staging_mib``; with the device
            update's own temporaries (and, at the first step, the states the base optimizer
            creates for one slice) this is all the device memory the states take.
            ``grad_sum_on="device"``: the chunks later micro-batches are added through.
    """

    num_offloaded: int
    num_on_device: int
    device_bytes_saved: int
    host_bytes: int
    pinned_bytes: int
    device_staging_bytes: int = 0


def engine_memory_report(table: ParameterTable, staging: Union[StagingRing, DeviceSumRing],
                         streamer: StateStreamer, *, gradients_on_host: bool,
                         conversion_bytes: int = 0) -> OffloadMemoryReport:
    """The report of ``OffloadOptimizer``'s memory, from its parameter table, staging ring and
    state streamer, whether the gradients live on the host between backward and the step (the
    device's copies then freed), and the bytes of the stepper's buffers for gradients converted
    before the step (plain host memory, ``slot_step.conversion_buffers``).

    Host buffers are counted as allocated, as ``OffloadOptimizer.plan_host_memory`` plans: on CUDA
    each at its size rounded up to a page, in one page-locked block; on other accelerators each at
    its size rounded up to a power of two (torch's pinned allocator); the staging ring's chunks,
    made by torch's pinned allocator on any accelerator, likewise.
    """
    pinned = table.pinning != NONE
    saved = host = pinned_total = 0
    for slot in table.offloaded:
        # With overlap a host step may be making these states now: list() copies each dict in one
        # step (a generator over it could meet a dict changing size). A state not made yet is not
        # counted: the first step's report may be short of the later ones.
        state_bytes = sum(
            t.numel() * t.element_size()
            for st in list(slot.optimizer.state.values())
            for t in list(st.values())
            if isinstance(t, torch.Tensor)
        )
        grad_bytes = slot.host_grad.numel() * slot.host_grad.element_size()
        held = sum(buffer_bytes(t.numel() * t.element_size(), pinning=table.pinning) for t in slot.host_buffers)
        host += state_bytes + held
        pinned_total += held
        saved += state_bytes + (grad_bytes if gradients_on_host else 0)
    # Streamed states: exact-size blocks, page-locked where the device allows, like the buffers.
    saved += streamer.state_bytes
    host += streamer.host_bytes
    pinned_total += streamer.host_bytes
    num_offloaded = len(table.offloaded) + len(table.streamed)
    # Of the host engine's memory only its buffers and the staging ring are pinned; its base
    # optimizers' states are plain host memory.
    staging_bytes = 0 if staging.on_device else staging.num_allocated * pinned_allocation_bytes(
        staging.chunk_bytes, pinned=pinned)
    return OffloadMemoryReport(
        num_offloaded=num_offloaded,
        num_on_device=len(table.slots) - num_offloaded,
        device_bytes_saved=saved,
        host_bytes=host + staging_bytes + conversion_bytes,
        pinned_bytes=pinned_total + staging_bytes if pinned else 0,
        device_staging_bytes=streamer.device_staging_bytes + (staging.nbytes if staging.on_device else 0),
    )
