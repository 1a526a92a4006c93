"""Host gradients: how each offloaded parameter's gradient reaches the host buffer its step reads.

The only writer of a slot's gradient record (:class:`HostGrad`): its life as one explicit state,
the copy and staging handles of the micro-batches on their way, and the gradient's norm where it
was measured before it left the device. The record is written from the training thread (backward
hooks, clipping, ``zero_grad``), an overlap landing thread (:meth:`HostGradients.land`; several
land at once, each a slot of its own) and the step thread (:meth:`HostGradients.consumed`);
futures order the writes to one record, so no two overlap.

With ``offload_gradients`` the first micro-batch of a window is copied into the host buffer (the
device copy is freed as the copy completes) and later ones are added into it through the bounded
:class:`~torchtune_offload.optim.staging.StagingRing`. Without it the device gradient is the
gradient, and the host buffer gets a copy of it for the step.
"""

import enum
from typing import Callable, List, Optional, Tuple, Union

import torch

from torchtune_offload.optim.grad_norm import (check_scale_factor, clip_, combine_norms, host_norms, tensor_norm,
                                               tensor_norms)
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.staging import DeviceSumRing, StagingRing
from torchtune_offload.optim.step_timings import StepTimings, profiled
from torchtune_offload.optim.step_together import first_of_each
from torchtune_offload.optim.transfer import TransferEngine


class GradState(enum.Enum):
    """Where a slot's host gradient buffer is in its life."""

    #: Holds no gradient: the next backward starts a fresh sum (or the buffer is not in use).
    EMPTY = "empty"
    #: Holds a gradient, some of it possibly still being copied or staged into it.
    ARRIVING = "arriving"
    #: Holds a complete gradient, ready to read or modify.
    READY = "ready"


class HostGrad:
    """One slot's gradient record (written only by :class:`HostGradients`).

    Attributes:
        state: see :class:`GradState`.
        event: the copy into the host buffer, until waited for.
        staged: the staging ring's token of the last micro-batch staged into the buffer.
        norm: the 2-norm of the gradient the next step uses, where measured before it left the
            device or as it landed (overlap, and serial ``offload_gradients``); None once consumed.
    """

    __slots__ = ("state", "event", "staged", "norm")

    def __init__(self) -> None:
        self.state = GradState.EMPTY
        self.event: Optional[object] = None
        self.staged: Optional[int] = None
        self.norm: Optional[torch.Tensor] = None


class HostGradients:
    """Lands, sums, measures and hands out the gradients the next step uses.

    Args:
        table: the slots.
        transfer: the device/host copy engine.
        timings: where the training thread's waits are counted.
        offload_gradients: gradients move to the host during backward and are summed there.
        sum_on: where later micro-batches are added into the host sums: ``"host"``
            (:class:`StagingRing`) or ``"device"`` (:class:`DeviceSumRing`).
    """

    def __init__(self, table: ParameterTable, transfer: TransferEngine, timings: StepTimings, *,
                 offload_gradients: bool, sum_on: str = "host") -> None:
        self._table = table
        self._transfer = transfer
        self._timings = timings
        self.offload_gradients = offload_gradients
        if sum_on == "device":  # its chunks hold pieces of the sums, in the sums' dtype
            self.staging = DeviceSumRing(transfer, device=transfer.device, largest_bytes=table.largest_host_grad_bytes)
        else:  # its chunks hold pieces of the gradients, in the parameters' dtype
            self.staging = StagingRing(transfer, largest_bytes=table.largest_offloaded_bytes)
        if offload_gradients:
            timings.count_sums(self.staging)
        self._records = [HostGrad() for _ in table.slots]

    def summed_on_host(self, slot: Slot) -> bool:
        """Whether the slot's gradient lives in its host buffer (offloaded, ``offload_gradients``)."""
        return slot.offloaded and self.offload_gradients

    def holds(self, slot: Slot) -> bool:
        """Whether the slot's host buffer holds a gradient."""
        return self._records[slot.index].state is not GradState.EMPTY

    def norm(self, slot: Slot) -> Optional[torch.Tensor]:
        return self._records[slot.index].norm

    # ------------------------------------------------------------------------- training thread

    def on_backward_group(self, slots: List[Slot], *, in_window: bool) -> None:
        """A backward completed the gradients of ``slots`` (a hand-off group, in arrival order):
        each measured where the next step's whole gradient is still on the device, and sent to the
        host where it goes there now. The group's norms are taken in one call (:func:`tensor_norms`)
        and the copies that send a gradient down whole (a window's first micro-batch, or a window's
        device gradients) are issued together, under one event.

        A gradient is measured on the device before it leaves, with serial ``offload_gradients``
        too, so that serial and overlapped windows clip alike to the bit (a device and the host
        reduce in different orders). A later micro-batch's sum is measured where it is added: on the
        host once it lands (the host ring), or by the device ring as it adds."""
        measured = [slot for slot in slots if (in_window or self.summed_on_host(slot))
                    and not (self.summed_on_host(slot) and self.holds(slot))]
        for slot, norm in zip(measured, tensor_norms([slot.param.grad for slot in measured])):
            self._records[slot.index].norm = norm
        copies: List[Tuple[Slot, torch.Tensor]] = []
        added: List[Tuple[Slot, torch.Tensor]] = []  # into their host sums through the ring
        for slot in slots:
            record, grad = self._records[slot.index], slot.param.grad
            if self.summed_on_host(slot):
                if record.state is GradState.EMPTY:
                    copies.append((slot, grad))
                    record.staged = None
                else:
                    added.append((slot, grad))
                record.state = GradState.ARRIVING
                slot.param.grad = None  # held in copies or added until its copy is issued
            elif in_window and slot.offloaded:
                copies.append((slot, grad))
                record.staged = None
                record.state = GradState.ARRIVING
        if added:
            pairs = [(slot.host_grad, grad) for slot, grad in added]
            if self.staging.on_device:  # the device measures each sum it leaves
                tokens, norms = self.staging.add_many_and_measure(
                    pairs, after=[self._records[slot.index].event for slot, _ in added])
            else:  # the host ring's sums are measured on the host once they land
                tokens, norms = self.staging.add_many(pairs), [None] * len(added)
            for (slot, _), token, norm in zip(added, tokens, norms):
                self._records[slot.index].staged = token
                self._records[slot.index].norm = norm
        if copies:
            event = self._transfer.to_host_many([slot.host_grad for slot, _ in copies], [g for _, g in copies],
                                                release_source=True)
            for slot, _ in copies:
                self._records[slot.index].event = event

    def send_for_step(self, slot: Slot) -> None:
        """Serial step without ``offload_gradients``: copies the device gradient to the host buffer."""
        self._send_device_grad(slot, release_source=False)

    def _send_device_grad(self, slot: Slot, *, release_source: bool) -> None:
        record = self._records[slot.index]
        record.staged = None
        record.event = self._transfer.to_host(slot.host_grad, slot.param.grad, release_source=release_source)
        record.state = GradState.ARRIVING

    def straggler(self, slot: Slot) -> bool:
        """Makes a gradient from earlier micro-batches only (the window's final backward did not
        reach the parameter) part of an overlapped window, as the backward hook would have.

        Returns:
            whether the slot has such a gradient.
        """
        record = self._records[slot.index]
        if self.summed_on_host(slot):
            if record.state is GradState.EMPTY:
                return False
            # record.norm: measured on the device by the hook if one micro-batch made the sum, or
            # by the device ring as it added the last one that did; else None (the host ring's sums
            # are measured on the host when they land), as in a serial window.
            record.staged = self.staging.issued
            return True
        if slot.param.grad is None:
            return False
        record.norm = tensor_norm(slot.param.grad)
        if slot.offloaded:
            self._send_device_grad(slot, release_source=True)
        return True

    def finish(self, slot: Slot) -> None:
        """Waits for the slot's gradient copies and folds its staged micro-batches into the sum."""
        record = self._records[slot.index]
        if record.state is not GradState.ARRIVING:
            return
        with self._timings.waiting("gradient copies"):
            self._transfer.wait(record.event)
            record.event = None
            # The ring adds in the order chunks were issued, whichever slots they belong to.
            self.staging.drain()
        record.state = GradState.READY

    def to_step(self) -> List[Tuple[Slot, torch.Tensor]]:
        """The gradients the next step() will use, with their slots, ready to read or modify
        (host work queued by the overlap scheduler must be finished first)."""
        grads = []
        for slot in self._table.slots:
            if self.summed_on_host(slot):
                if self.holds(slot):
                    self.finish(slot)
                    grads.append((slot, slot.host_grad))
            elif slot.param.grad is not None:
                grads.append((slot, slot.param.grad))
        return grads

    def norms(self, grads: List[Tuple[Slot, torch.Tensor]], norm_type: Union[float, str]) -> List[torch.Tensor]:
        """Each gradient's ``norm_type`` norm, reusing a 2-norm measured before it left the device."""
        reuse = float(norm_type) == 2.0
        norms = [self.norm(slot) if reuse else None for slot, _ in grads]
        # Host sums not measured yet (the host ring's, in a serial window), on several cores at once.
        host = [i for i, (slot, grad) in enumerate(grads) if norms[i] is None and grad is slot.host_grad]
        for i, norm in zip(host, host_norms([grads[i][1] for i in host], norm_type=norm_type)):
            norms[i] = norm
        return [norm if norm is not None else tensor_norm(grad, norm_type=norm_type)
                for norm, (_, grad) in zip(norms, grads)]

    def clip_(self, grads: List[Tuple[Slot, torch.Tensor]], max_norm: Union[float, torch.Tensor],
              norm_type: Union[float, str], *, device: torch.device, error_if_nonfinite: bool,
              combine: Callable[..., torch.Tensor] = combine_norms) -> torch.Tensor:
        """Clips ``grads`` (from :meth:`to_step`) as ``torch.nn.utils.clip_grad_norm_`` would, their
        total norm being ``combine`` of their norms, and drops their measured norms; returns the
        total norm before clipping, on ``device``."""
        norm = combine(self.norms(grads, norm_type), norm_type=norm_type, device=device,
                             error_if_nonfinite=error_if_nonfinite)
        clip_([g for _, g in grads], max_norm=max_norm, norm=norm)
        self.forget_norms()
        return norm

    def scale_(self, grads: List[Tuple[Slot, torch.Tensor]], factor: Union[float, torch.Tensor]) -> None:
        """Multiplies ``grads`` (from :meth:`to_step`) by ``factor`` and drops their measured norms.

        Raises:
            ValueError: for a number ``factor`` that is not finite, before any gradient changes.
        """
        check_scale_factor(factor)
        for _, g in grads:
            g.mul_(factor.to(g.device) if isinstance(factor, torch.Tensor) else factor)
        self.forget_norms()

    def forget_norms(self) -> None:
        """Drops measured norms once the gradients they describe have been changed."""
        for record in self._records:
            record.norm = None

    def forget_norm(self, slot: Slot) -> None:
        """Drops the slot's norm: the step consumes the gradient it describes."""
        self._records[slot.index].norm = None

    def zero(self, slot: Slot, *, set_to_none: bool, host: bool) -> None:
        """``zero_grad`` of the slot's device gradient, and of its host sum where ``host``."""
        if slot.param.grad is not None:
            if set_to_none:
                slot.param.grad = None
            else:
                slot.param.grad.zero_()
        if not host or not self.holds(slot):
            return
        self.finish(slot)
        record = self._records[slot.index]
        if set_to_none:
            record.state = GradState.EMPTY
        else:
            slot.host_grad.zero_()
            record.norm = None

    # ---------------------------------------------------------- landing and step threads

    def land(self, slots: List[Slot]) -> None:
        """Landing thread: the window's gradients of ``slots`` are complete in their host buffers,
        and measured, when this returns (the norms not measured on the device in one call)."""
        records = [self._records[slot.index] for slot in slots]
        with profiled("land"):
            for record in first_of_each(records, key=lambda record: record.event):  # a group's copies share one
                self._transfer.wait(record.event)
            staged = [record.staged for record in records if record.staged is not None]
            if staged:
                self.staging.drain_until(max(staged))
            unmeasured = [(slot, record) for slot, record in zip(slots, records) if record.norm is None]
            if unmeasured:
                for (_, record), norm in zip(unmeasured, tensor_norms([slot.host_grad for slot, _ in unmeasured])):
                    record.norm = norm

    def consumed(self, slot: Slot) -> None:
        """A step has used the slot's host gradient (or overwritten its buffer with new weights):
        the next backward starts a fresh sum."""
        record = self._records[slot.index]
        record.state = GradState.EMPTY
        record.event = None
        record.staged = None
