"""The overlap scheduler of ``OffloadOptimizer(overlap=True)``: the announced window, the host
workers, the forward waits and the stragglers (see ``overlap.py`` for how the pieces fit).

The only writer of the window and of each slot's queued host work (its landing, its step and the
upload's event). Every wait can time out (``overlap_timeout_s``) with an error that says what it
was waiting for, instead of hanging on a stuck worker.
"""

import concurrent.futures
import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from torchtune_offload.optim.grad_norm import clip_, clip_coefficient, combine_norms
from torchtune_offload.optim.handoff import BackwardHandoff, handoff_groups
from torchtune_offload.optim.host_grads import HostGradients
from torchtune_offload.optim.overlap import (HostWorkers, Window, changed_hyperparameters, hyperparameters,
                                             register_module_waits)
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.slot_step import SlotStepper, param_bytes
from torchtune_offload.optim.step_timings import StepTimings, profiled
from torchtune_offload.optim.step_together import first_of_each, runs
from torchtune_offload.optim.transfer import TransferEngine

#: The most host-gradient bytes one landing job measures: a layer of a narrow model lands as one job
#: (one hand-over to a landing thread, not one per parameter), an 8B layer's large matrices one a
#: job, on as many landing threads as the host has cores (a norm runs on one core).
LANDING_BYTES = 32 * 2**20


class _Queued:
    """One slot's host work of the current or previous window (written by the scheduler only)."""

    __slots__ = ("landed", "done", "param_event")

    def __init__(self) -> None:
        self.landed: Optional[concurrent.futures.Future] = None
        self.done: Optional[concurrent.futures.Future] = None
        self.param_event = None


class OverlapScheduler:
    """Runs announced windows' host work on worker threads and makes the training thread wait
    only where it must.

    Args:
        table: the slots.
        grads: the gradient records the workers land and consume.
        stepper: what the step thread runs.
        transfer: orders the compute stream after uploads.
        timings: where the training thread's waits are counted.
        timeout_s: the longest wait for one piece of host work; None waits without a limit.
        handoff: ``"group"`` (a hand-off per layer or bucket) or ``"parameter"`` (one per gradient, and
            without clipping a landing and a host-step job per gradient too).
    """

    def __init__(self, table: ParameterTable, grads: HostGradients, stepper: SlotStepper,
                 transfer: TransferEngine, timings: StepTimings, *, timeout_s: Optional[float],
                 handoff: str = "group") -> None:
        self._table = table
        self._grads = grads
        self._stepper = stepper
        self._transfer = transfer
        self._timings = timings
        self._timeout_s = timeout_s
        self._queued = [_Queued() for _ in table.slots]
        self.window: Optional[Window] = None
        self.workers: Optional[HostWorkers] = None
        self.forward_waits = False
        self._hooks: List[Any] = []
        # The window's offloaded slots handed over and not yet sent to the landing threads.
        self._unlanded: List[Slot] = []
        self._unlanded_bytes = 0
        self._per_parameter = handoff == "parameter"
        #: Collects the backward's gradients per layer or bucket (or parameter) and hands each group to
        #: take_backward_grads.
        self.handoff = BackwardHandoff(
            handoff_groups([s.key for s in table.slots], [param_bytes(s) for s in table.slots],
                           per_parameter=self._per_parameter),
            self.take_backward_grads, flushed=self._after_backward)

    def group_handoff(self, groups: Sequence[Sequence[Slot]]) -> None:
        """Makes each of ``groups`` one hand-off group (``OffloadOptimizer.group_handoff``); slots in none
        keep their layer's or bucket's group.

        Raises:
            ValueError: with ``handoff="parameter"``, which these groups would override.
        """
        if self._per_parameter:
            raise ValueError("optimizer.handoff=parameter with groups of parameters handed over together (FSDP2's "
                             "units): each gradient would no longer go alone. Remove it (~optimizer.handoff).")
        ids = list(self.handoff.groups)
        fresh = max(ids, default=-1) + 1
        for number, group in enumerate(groups, start=fresh):
            for slot in group:
                ids[slot.index] = number
        self.handoff.regroup(ids)

    def pending(self, slot: Slot) -> Optional[concurrent.futures.Future]:
        """The slot's queued host step, if any (for tests and diagnostics)."""
        return self._queued[slot.index].done

    # ------------------------------------------------------------------------- the window

    def announce(self, *, clipping: bool, param_groups: List[Dict[str, Any]]) -> None:
        """Opens the window whose final backward comes next (see ``OffloadOptimizer.expect_final_backward``)."""
        if self.window is not None:
            raise RuntimeError("expect_final_backward() twice without step() in between.")
        # The previous window's steps: done by now, as the forward before this backward waited.
        self.synchronize()
        self.window = Window(clipping=bool(clipping), hyper=hyperparameters(param_groups))
        if not clipping:
            self._stepper.sync_hyperparameters(param_groups)

    def on_backward_grad(self, slot: Slot) -> None:
        """The per-parameter backward hook's whole work: a second backward in an announced window
        is refused at its first gradient, before its accumulations race with the window's copies;
        else the gradient is counted towards its group's hand-off."""
        if self.window is not None and slot.index in self.window.seen:
            raise RuntimeError(
                f"{slot.key}: a second backward after expect_final_backward(); call it before "
                "the last backward of the window only, then step()."
            )
        self.handoff.on_grad(slot.index)

    @torch.no_grad()
    def take_backward_grads(self, indices: List[int]) -> None:
        """A group's gradients for this backward are complete (``optim/handoff.py``): each measured,
        sent towards the host and, in an announced window, queued for the host workers, in the
        order they arrived."""
        with profiled("gradient hook"):  # the range's name as trace summaries read it
            # A gradient freed meanwhile (zero_grad after a backward that raised) is not taken.
            slots = [self._table.slots[i] for i in indices if self._table.slots[i].param.grad is not None]
            self.before_backward_grads(slots)
            self._grads.on_backward_group(slots, in_window=self.window is not None)
            if self.window is not None:
                self._hand_over([slot for slot in slots if slot.offloaded])

    def before_backward_grads(self, slots: List[Slot]) -> None:
        """The hand-off's first act on a group's slots: the previous window's work on them is
        finished (by now, unless no forward ran) and they join the open window's record (a second
        backward was refused by :meth:`on_backward_grad`)."""
        self.wait_done(slots)
        window = self.window
        if window is None:
            return
        window.seen.update(slot.index for slot in slots)
        window.order.extend(slot.index for slot in slots)

    def _hand_over(self, slots: List[Slot]) -> None:
        """Queues the landing of a group's offloaded window gradients, and without clipping the
        group's steps, one job for the step thread. With clipping (nothing steps before every
        gradient has landed) the landings wait until :data:`LANDING_BYTES` of them, or the end of
        the backward, and go as one job: a narrow model's layers do not each wake a landing thread."""
        if not slots:
            return
        if self.workers is None:
            self.workers = HostWorkers()
        self._unlanded.extend(slots)
        self._unlanded_bytes += sum(slot.host_grad.nbytes for slot in slots)
        if not self.window.clipping or self._unlanded_bytes >= LANDING_BYTES:
            self._send_landings()
        if not self.window.clipping:
            self._queue_steps(slots, None)

    def _after_backward(self) -> None:
        """The end of a backward (or of a flush before the gradients are read): the host ring's
        waiting additions start beside the next forward, and the window's landings are sent."""
        self._grads.staging.send()
        self._send_landings()

    def _send_landings(self) -> None:
        """Sends the landings handed over so far to the landing threads, a job per run of at most
        :data:`LANDING_BYTES` (the landing threads share the jobs out)."""
        if not self._unlanded:
            return
        unlanded, self._unlanded, self._unlanded_bytes = self._unlanded, [], 0
        for run in runs(unlanded, key=lambda _slot: (), nbytes=lambda slot: slot.host_grad.nbytes, bound=LANDING_BYTES):
            landed = self.workers.land(self._land, run)
            for slot in run:
                self._queued[slot.index].landed = landed

    def _queue_steps(self, slots: List[Slot], coef: Optional[torch.Tensor]) -> None:
        """Queues the host steps of ``slots`` (of one hand-off group, or a few small ones) as one job
        of the step thread, which each slot's forward wait waits for."""
        done = self.workers.step(self._host_steps, slots, coef)
        for slot in slots:
            self._queued[slot.index].done = done

    @torch.no_grad()  # grad mode is per thread: the workers start in the default mode
    def _land(self, slots: List[Slot]) -> None:
        self._grads.land(slots)

    @torch.no_grad()
    def _host_steps(self, slots: List[Slot], coef: Optional[torch.Tensor]) -> None:
        """Step thread: steps the landed slots on the host, a module's together, and sends each
        module's new weights up as soon as they are stepped."""
        for unit in self._stepper.by_unit(slots):
            for slot in first_of_each(unit, key=lambda slot: self._queued[slot.index].landed):
                landed = self._queued[slot.index].landed
                if landed is None:
                    raise RuntimeError(f"{slot.key}: stepped before its gradient was sent to land")
                self._result(landed, f"{slot.key}: the landing of its gradient")
            # The clipping factor goes with the step, which scales the gradients or has its pass do it as it reads.
            self._stepper.host_step(unit, waited=False, done=self._stepped, grad_scale=coef)

    def _stepped(self, slot: Slot, event: object) -> None:
        """Step thread: the slot's new weights are on their way up (``event``); the window's sum is
        consumed, so the next backward starts a fresh one."""
        self._queued[slot.index].param_event = event
        self._grads.consumed(slot)

    def _land_stragglers(self, window: Window) -> None:
        """Hands over the gradients of parameters the final backward did not reach (used only in
        earlier micro-batches), so that the window's record is complete."""
        self.handoff.flush()  # what a backward that raised left collected, first
        for slot in self._table.slots:
            if slot.index in window.seen or not self._grads.straggler(slot):
                continue
            window.seen.add(slot.index)
            window.stragglers.append(slot.index)
            if slot.offloaded:
                self._hand_over([slot])
        self._send_landings()

    def norms(self) -> List[torch.Tensor]:
        """Each window gradient's 2-norm, in slot order, once landed."""
        window = self.window
        self._land_stragglers(window)
        seen = [slot for slot in self._table.slots if slot.index in window.seen]
        self.wait_landed(seen)
        return [self._grads.norm(slot) for slot in seen]

    def clip(self, max_norm: float, norm_type: Any, *, device: torch.device, error_if_nonfinite: bool,
             combine: Callable[..., torch.Tensor] = combine_norms) -> torch.Tensor:
        """Clips the window's gradients by their total 2-norm (``combine`` of their norms): device
        ones now, host ones by the step thread before stepping. Returns the total norm."""
        window = self.window
        if not window.clipping:
            raise RuntimeError(
                "clip_grad_norm_() in a window announced with expect_final_backward(clipping=False): "
                "its host steps have already started. Announce clipping=True to clip."
            )
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type={norm_type}: an overlapped window clips by the 2-norm only.")
        norm = combine(self.norms(), norm_type=2.0, device=device, error_if_nonfinite=error_if_nonfinite)
        window.coef = clip_coefficient(max_norm=max_norm, norm=norm)
        clip_([s.param.grad for s in self._table.slots if not s.offloaded and s.param.grad is not None],
              max_norm=max_norm, norm=norm)
        return norm

    def step(self, param_groups: List[Dict[str, Any]]) -> None:
        """Steps the window: device-resident slots now, offloaded ones queued (with clipping, in
        the order the next forward uses them)."""
        window = self.window
        self._land_stragglers(window)
        if window.clipping:
            self._stepper.sync_hyperparameters(param_groups)
        else:
            changed = changed_hyperparameters(window.hyper, hyperparameters(param_groups))
            if changed:
                self.window = None
                self.synchronize()
                raise RuntimeError(
                    "hyper-parameters changed between expect_final_backward(clipping=False) and step(), "
                    "after the host steps had used them: " + "; ".join(changed)
                    + ". Change them after step() (as LR schedulers do), or announce clipping=True."
                )
        self._stepper.step_on_device()
        if window.clipping:
            coef = None if window.coef is None else window.coef.to("cpu")
            # The next forward uses the parameters in the reverse of backward's order: the
            # stragglers one by one, then each hand-off group's run of them as one job.
            offloaded = [self._table.slots[i] for i in window.stragglers + window.order[::-1]
                         if self._table.slots[i].offloaded]
            stragglers = set(window.stragglers)

            def job(slot: Slot) -> tuple:
                if slot.index in stragglers:
                    return ("straggler", slot.index)
                return ("group", self.handoff.group_of(slot.index))

            # Consecutive jobs of few bytes go as one (a narrow model's layers; an 8B layer alone).
            for joined in self._stepper.join([list(run) for _, run in itertools.groupby(offloaded, key=job)]):
                self._queue_steps(joined, coef)
        self.window = None
        if not self.forward_waits:
            # Nothing makes the next forward wait per module: wait here, still after backward.
            self.synchronize()

    # ------------------------------------------------------------------------------ waits

    def _result(self, future: concurrent.futures.Future, what: str) -> Any:
        try:
            return future.result(timeout=self._timeout_s)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(
                f"overlap: waited {self._timeout_s} s for {what}, which did not finish. A host worker is "
                "stuck or far slower than expected; raise optimizer.overlap_timeout_s, or set it to null "
                "to wait without a limit."
            ) from None

    def wait_done(self, slots: Sequence[Slot]) -> None:
        """Blocks until the queued steps of ``slots`` are done, and orders the compute stream after
        their uploads: each job and each upload waited for once (a module's slots share them)."""
        pending = [(slot, self._queued[slot.index]) for slot in slots if self._queued[slot.index].done is not None]
        if not pending:
            return
        with self._timings.waiting("host step"):
            for slot, queued in first_of_each(pending, key=lambda pair: pair[1].done):
                self._result(queued.done, f"{slot.key}: its host step")
        for _, queued in first_of_each(pending, key=lambda pair: pair[1].param_event):
            self._transfer.compute_waits_for(queued.param_event)
        for slot, queued in pending:
            # The window's gradient is consumed, and with it its norm.
            queued.done = queued.landed = queued.param_event = None
            self._grads.forget_norm(slot)

    def wait_landed(self, slots: Sequence[Slot]) -> None:
        """Blocks until the gradients of ``slots`` have landed (each landing job waited for once)."""
        self._send_landings()
        sent = [slot for slot in slots if self._queued[slot.index].landed is not None]
        for slot in first_of_each(sent, key=lambda slot: self._queued[slot.index].landed):
            queued = self._queued[slot.index]
            with self._timings.waiting("gradient landing"):
                self._result(queued.landed, f"{slot.key}: the landing of its gradient")

    def synchronize(self) -> None:
        """Hands over what is collected from a backward, then waits for every queued host step and
        upload; errors raised in a worker are raised here."""
        self.handoff.flush()
        self.wait_done(self._table.slots)
        self.wait_landed(self._table.slots)

    # ----------------------------------------------------------------------- forward waits

    def register_forward_waits(self, model: torch.nn.Module, *, units: Optional[Sequence[Any]] = None) -> None:
        """Each module of ``model`` waits, right before its forward, for its own parameters' host
        steps and uploads; ``model.state_dict()`` waits for all of them. ``units``: the modules that
        wait instead, as ``overlap.register_module_waits`` takes them."""
        def own(param: torch.nn.Parameter) -> Optional[Slot]:
            slot = self._table.slot_of.get(param)
            return slot if slot is not None and slot.offloaded else None

        handles, _ = register_module_waits(model, own, self.wait_done, self.synchronize, units=units)
        self._hooks.extend(handles)
        self.forward_waits = True

    def close(self) -> None:
        """Removes the forward waits and stops the workers (after what they have queued)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.forward_waits = False
        if self.workers is not None:
            self._send_landings()
            self.workers.shutdown()
            self.workers = None
