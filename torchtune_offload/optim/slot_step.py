"""The update of one slot: its base optimizer's step (or the fused master pass) on the gradient it
is given, wherever that gradient is.

This is the seam for *how* an update runs. Today an offloaded slot's update runs on the host, in
its base optimizer's own state format (or, for fp32 masters of bf16 parameters under Adam/AdamW,
in ``fused_step``'s one-pass C loop); device-resident slots update on the device. Another
placement of the update (states streamed to the device) or another state format (a fused
low-bit kernel) is another implementation of :meth:`SlotStepper.step_slot`, leaving the gradient
path and the scheduling as they are.
"""

from contextlib import nullcontext
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.optim.fp8_weights import DeviceWeights
import torchtune_offload.optim.fused_step as fused_step
from torchtune_offload.optim.host_buffers import converted_before_step
from torchtune_offload.optim.host_grads import HostGradients
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.state_plan import unit_of
from torchtune_offload.optim.state_streamer import StateStreamer
from torchtune_offload.optim.step_timings import StepTimings
from torchtune_offload.optim.step_together import runs, step_together
import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.transfer import TransferEngine

#: The most parameter bytes of consecutive modules one host step takes (one base-optimizer call
#: where their options allow, one upload launch): modules larger than this go one at a time.
STEP_JOB_BYTES = 32 * 2**20


class SlotStepper:
    """Steps slots, a module's offloaded ones at a time (small modules a few together): serially
    after backward, or on the overlap step thread.

    Args:
        table: the slots.
        grads: the gradients to step on.
        transfer: sends the updated weights back to the device.
        timings: where host-step seconds are counted.
        fused_master_step: use the fused one-pass master update where it applies.
        streamer: updates the streamed slots (``update_on="device"``).
        device_weights: ``device_weights="fp8"``: uploads FP8 images of the masters instead of weights.
    """

    def __init__(self, table: ParameterTable, grads: HostGradients, transfer: TransferEngine,
                 timings: StepTimings, *, fused_master_step: bool, streamer: StateStreamer,
                 device_weights: Optional[DeviceWeights] = None) -> None:
        self._table = table
        self._streamer = streamer
        self._grads = grads
        self._transfer = transfer
        self._timings = timings
        self.fused_master_step = fused_master_step
        self.device_weights = device_weights
        # One buffer per stepped dtype for host gradients of another dtype than their stepped copy
        # (fp32 sums of bf16 weights without masters; bf16 gradients of fp32 masters that the fused
        # pass does not step), kept from step to step: a tensor made anew at each step is fresh
        # memory, whose first touch (the kernel's page faults) cost several times the conversion
        # itself on the CPU machine (docs/accumulation.md). The lock only guards against two threads
        # stepping at once, which neither the serial path nor the overlap step thread does.
        self._converted = conversion_buffers(table.offloaded, fused_master_step=fused_master_step)
        self._converting = stream_check.HostLock()
        # The module whose forward waits for each offloaded slot: its uploads go in one launch.
        self._units = {slot.index: unit_of(slot.key) for slot in table.offloaded}
        # What each offloaded slot shares with those stepped by one base-optimizer call, and its
        # share of their temporaries: fixed at construction, read at every step.
        self._together = {slot.index: (_run_key(slot), _multi_tensor_bytes(slot)) for slot in table.offloaded}
        # Where a slot's options take the multi-tensor loop (foreach=True), a run stepped together
        # holds at most the largest parameter's bytes: its temporaries (one state's worth of the
        # whole run) then never exceed one slot's alone. The single-tensor loop and the fused
        # kernel make one tensor's temporaries at a time, or none.
        self._together_bytes = table.largest_offloaded_bytes

    @property
    def conversion_bytes(self) -> int:
        """Host bytes of the buffers that host gradients are converted into before a step."""
        return sum(b.numel() * b.element_size() for b in self._converted.values())

    def step_slot(self, slot: Slot, grad: torch.Tensor, *, grad_scale: Optional[torch.Tensor] = None) -> None:
        """One base-optimizer step of ``slot`` on ``grad``; with a master, the result rounded into ``slot.out``.

        Args:
            slot: the slot.
            grad: its gradient.
            grad_scale: a clipping factor: the step is the one on ``grad.mul_(grad_scale)``. The
                fused master pass, and a base optimizer that declares ``scales_gradients_in_step``
                (AdamW8bit) stepping on this very gradient, take the factor and leave ``grad`` as it
                is (their C passes multiply as they read it); otherwise ``grad`` is scaled in place first.
        """
        if (slot.has_master and slot.offloaded and self.fused_master_step
                and fused_step.supports(slot.optimizer, grad, slot.out)
                and fused_step.fused_adamw_step(slot.optimizer, grad, slot.out, grad_scale=grad_scale)):
            return
        # An optimizer that takes the factor gets it only where it steps on this very gradient: a
        # master's widened copy must be scaled (and rounded) in the gradient's own dtype first.
        step_options = {}
        if grad_scale is not None:
            if (capabilities_of(type(slot.optimizer)).scales_gradients_in_step
                    and grad.dtype == slot.step_param.dtype):
                step_options["grad_scale"] = grad_scale
            else:
                grad.mul_(grad_scale)
        # A master is fed the gradient widened to its dtype, as plain fp32 training would be; a host
        # sum wider than its parameter is rounded to the parameter's. An offloaded slot's host
        # gradient is converted into its kept buffer (none on the device, nor where the fused pass
        # was expected but could not be built here: a new tensor then, as before the buffers).
        dtype = slot.step_param.dtype
        buffer = self._converted.get(dtype) if slot.offloaded and grad.dtype != dtype else None
        if buffer is not None and (grad.device.type != "cpu" or buffer.numel() < grad.numel()):
            buffer = None
        with self._converting if buffer is not None else nullcontext():
            if grad.dtype == dtype:
                stepped = grad
            elif buffer is not None:
                stepped = buffer[:grad.numel()].view(grad.shape)
                stepped.copy_(grad)  # the bits of grad.to(dtype)
            else:
                stepped = grad.to(dtype)
            slot.step_param.grad = stepped
            slot.optimizer.step(**step_options)
            slot.step_param.grad = None
        if slot.has_master:
            slot.out.copy_(slot.step_param)

    def sync_hyperparameters(self, param_groups: List[Dict[str, Any]]) -> None:
        """Copies what schedulers changed in the outer ``param_groups`` into each base optimizer."""
        for slot in self._table.slots:
            inner = slot.optimizer.param_groups[0]
            for k, v in param_groups[slot.group_index].items():
                if k != "params":
                    inner[k] = v

    def step_on_device(self) -> None:
        """Steps the parameters that stay on the device (on an accelerator, beside the host work);
        streamed slots through the streamer, which may queue them for the next forward."""
        streamed = []
        for slot in self._table.slots:
            if slot.offloaded:
                continue
            self._grads.forget_norm(slot)  # an announced window's, of the gradient this step consumes
            if slot.param.grad is not None:
                if slot.streamed:
                    streamed.append(slot)
                elif slot.has_master:
                    self.step_slot(slot, slot.param.grad)
                else:
                    slot.optimizer.step()
        self._streamer.update(streamed)

    def host_step(self, slots: List[Slot], *, waited: bool, done: Callable[[Slot, object], None],
                  grad_scale: Optional[torch.Tensor] = None) -> None:
        """Steps offloaded slots of one module on their landed host gradients and sends their new
        weights up in one launch.

        Args:
            slots: offloaded slots of a module or a few (see :meth:`by_unit`) whose gradients are complete
                in ``slot.host_grad``.
            waited: the training thread runs it (serial), so all of it counts as waiting.
            done: called with each stepped slot and its upload's event (see
                ``TransferEngine.to_device_many``) once the upload is launched; where a step raises,
                the slots stepped before it are sent up and given to ``done`` all the same.
            grad_scale: a clipping factor for the gradients (see :meth:`step_slot`).
        """
        stepped: List[Slot] = []
        try:
            self._step_on_host(slots, stepped, waited=waited, grad_scale=grad_scale)
        finally:
            if stepped:
                dsts: List[torch.Tensor] = []
                srcs: List[torch.Tensor] = []
                for slot in stepped:
                    for pending, made in zip((dsts, srcs), self._uploads(slot)):
                        pending.extend(made)
                event = self._transfer.to_device_many(dsts, srcs)
                for slot in stepped:
                    done(slot, event)

    def by_unit(self, slots: List[Slot]) -> List[List[Slot]]:
        """``slots`` in runs of consecutive ones of one module (``state_plan.unit_of``), consecutive
        modules joined while they hold at most :data:`STEP_JOB_BYTES` of parameters: what one
        :meth:`host_step` takes, so that each module's weights go up as soon as they are stepped (an
        8B layer's alone; a narrow model's layers together, whose base-optimizer call would
        otherwise cost more than their arithmetic)."""
        return self.join([list(unit) for _, unit in itertools.groupby(slots, key=lambda slot: self._units[slot.index])])

    @staticmethod
    def join(jobs: List[List[Slot]]) -> List[List[Slot]]:
        """Consecutive ``jobs`` (lists of slots) joined while they hold at most :data:`STEP_JOB_BYTES`
        of parameters; a larger one alone."""
        joined = runs(jobs, key=lambda _job: (), nbytes=lambda job: sum(map(param_bytes, job)), bound=STEP_JOB_BYTES)
        return [[slot for job in run for slot in job] for run in joined]

    def _step_on_host(self, slots: List[Slot], stepped: List[Slot], *, waited: bool,
                      grad_scale: Optional[torch.Tensor] = None) -> None:
        """Steps ``slots`` run by run (:meth:`_together_key`), appending each run to ``stepped`` once done."""
        # Host code: what the base optimizer creates from nothing (its step count) is host memory.
        with self._timings.host_step(waited=waited), stream_check.host_work():
            for run in runs(slots, key=self._together_key, nbytes=lambda slot: self._together[slot.index][1],
                            bound=self._together_bytes):
                if len(run) == 1:
                    self.step_slot(run[0], run[0].host_grad, grad_scale=grad_scale)
                else:
                    self._step_run(run, grad_scale=grad_scale)
                stepped.extend(run)

    def _together_key(self, slot: Slot) -> Optional[tuple]:
        """The slot's :func:`_run_key`, or None (alone) while its learning rate is a tensor (a
        scheduler may set one)."""
        key, _ = self._together[slot.index]
        return None if isinstance(slot.optimizer.param_groups[0]["lr"], torch.Tensor) else key

    def _step_run(self, run: List[Slot], *, grad_scale: Optional[torch.Tensor]) -> None:
        """Steps a run of one :meth:`_together_key` with its first slot's base optimizer: each slot's
        update as :meth:`step_slot`'s, to the bit (the clipping factor too: an optimizer that
        scales gradients in its step takes it, else each gradient is scaled in place first)."""
        optimizer = run[0].optimizer
        grads = [slot.host_grad for slot in run]
        step_options = {}
        if grad_scale is not None:
            if capabilities_of(type(optimizer)).scales_gradients_in_step:
                step_options["grad_scale"] = grad_scale
            else:
                torch._foreach_mul_(grads, grad_scale)  # each gradient's mul_, in one dispatch
        params = [slot.step_param for slot in run]
        for param, grad in zip(params, grads):
            param.grad = grad
        try:
            after = step_together(optimizer, params, [slot.optimizer.state[slot.step_param] for slot in run],
                                  **step_options)
        finally:
            for param in params:
                param.grad = None
        for slot, state in zip(run, after):
            slot.optimizer.state[slot.step_param] = state

    def _uploads(self, slot: Slot) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        """What a host-stepped slot's upload copies: device tensors, and the host tensors for them."""
        if self.fp8(slot):
            # Re-quantized into the consumed gradient buffer: the caller marks it consumed.
            return self.device_weights.images(slot)
        return [slot.param], [slot.result]

    def fp8(self, slot: Slot) -> bool:
        """The slot's device weight is an FP8 image (its upload overwrites its host gradient buffer)."""
        return self.device_weights is not None and self.device_weights.holds(slot)

    def step_serial(self, param_groups: List[Dict[str, Any]]) -> None:
        """Steps every slot that has a gradient, on the training thread, after backward."""
        self.sync_hyperparameters(param_groups)
        ready = []
        for slot in self._table.offloaded:
            if self._grads.summed_on_host(slot):
                if self._grads.holds(slot):
                    ready.append(slot)
            elif slot.param.grad is not None:
                # Issue every copy first, so later copies stream while earlier slots step.
                self._grads.send_for_step(slot)
                ready.append(slot)
        self.step_on_device()
        # Each module's slots (small consecutive modules' together) step and go up in one launch.
        for unit in self.by_unit(ready):
            for slot in unit:
                self._grads.finish(slot)
            self.host_step(unit, waited=True, done=self._consumed_if_no_sum)
        # The next forward must see the new parameters.
        self._transfer.compute_waits_for_copies()

    def _consumed_if_no_sum(self, slot: Slot, _event: object) -> None:
        """After a serial host step: a buffer that now holds the new weights, or held only a copy of
        the device gradient, is no gradient sum, and the next backward must not add into it."""
        if slot.out is slot.host_grad or not self._grads.summed_on_host(slot) or self.fp8(slot):
            self._grads.consumed(slot)


def param_bytes(slot: Slot) -> int:
    """The bytes of the slot's parameter (the device tensor's shape and dtype)."""
    return slot.param.numel() * slot.param.element_size()


def _run_key(slot: Slot) -> Optional[tuple]:
    """What offloaded slots stepped by one base-optimizer call share (``optim/step_together.py``), or
    None where the slot steps alone: an optimizer that declares ``steps_tensors_apart`` stepping the
    host gradient itself (no master, no conversion), with host-side options only (not capturable or
    differentiable); its class and parameter group (the same options) are the key."""
    optimizer = slot.optimizer
    if not capabilities_of(type(optimizer)).steps_tensors_apart or slot.has_master or slot.host_grad is None:
        return None
    if slot.host_grad.dtype != slot.step_param.dtype or slot.host_grad.device.type != "cpu":
        return None
    group = optimizer.param_groups[0]
    if group.get("capturable") or group.get("differentiable"):
        return None
    return type(optimizer), slot.group_index


def _multi_tensor_bytes(slot: Slot) -> int:
    """The slot's share of a run's temporaries where its options take the multi-tensor loop."""
    if not slot.optimizer.param_groups[0].get("foreach"):
        return 0
    return param_bytes(slot)


def conversion_buffers(offloaded: List[Slot], *, fused_master_step: bool) -> Dict[torch.dtype, torch.Tensor]:
    """For each dtype that offloaded slots' host gradients are converted to before their step (a sum
    wider than its parameter without a master; a gradient narrower than its master where the fused
    pass will not step it), a host buffer as large as the largest such gradient: what
    :class:`SlotStepper` converts them into."""
    largest: Dict[torch.dtype, int] = {}
    for slot in filter(lambda slot: slot.host_grad is not None, offloaded):
        grad = slot.host_grad
        fused = slot.has_master and fused_master_step and fused_step.supports(slot.optimizer, grad, slot.out)
        converted = converted_before_step(slot.param.dtype, stepped=slot.step_param.dtype, grad=grad.dtype, fused=fused)
        if converted is not None:
            largest[converted] = max(largest.get(converted, 0), grad.numel())
    # Host memory, whatever the device: the stream checker must not take the buffer for the device's.
    return {dtype: stream_check.host_tensor(torch.empty(n, dtype=dtype)) for dtype, n in largest.items()}
