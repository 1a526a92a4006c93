"""``update_on="device"``: optimizer states in (pinned) host memory, updates on the device.

The design of axlearn PR #867 ("weight-only offloading"): parameters and gradients stay on the
device; only the optimizer states of the *streamed* slots (see ``param_table.Slot.streamed``) live
in host memory, in exact-size blocks page-locked where the device allows (``host_arena``). At
``step()`` each streamed slot's states are brought to the device through a bounded staging area,
the slot's base optimizer updates the parameter there with its own kernel, and the states go back.
The results are plain training's by construction and the host does no arithmetic.

Chunking. No tensor needs a full-size device copy of its states: the staging area is two buffers
of half the bound (``device_staging_mib``) each, and a slot whose base optimizer updates elementwise
(``capabilities.elementwise_update``: torch's Adam, AdamW, SGD, ...) is stepped slice by slice along
the flattened tensor, alternating buffers, so that on an accelerator the upload of one slice, the
update of the one before and the download of the one before that overlap (one stream each). A slot
whose states are not elementwise (blockwise 8-bit states with their absmax, factored states) is
staged whole in one buffer; a bound too small for it is refused when the optimizer is built. Slices
are whole multiples of :data:`SLICE_ELEMENTS` elements, so that vectorised kernels see the same
alignment as for the whole tensor.

Between steps the base optimizer's ``state`` holds the host tensors (and its scalar states, such as
the step count, where it keeps them), so its ``state_dict`` is the checkpoint as it is. Each step
swaps in device views for one slice at a time, resetting the scalar states to their value before
the step, and keeps the scalars of the last slice: every slice sees the same step count.

Ordering. Without ``overlap`` (or without forward waits) every update runs in ``step()``, on the
compute stream. With ``overlap`` and ``register_forward_waits`` they run in the next forward's order:
on a side stream, each module's forward waiting only for its own parameters' updates (on a CPU the
stand-in streams of ``stream_order`` run them in ``step()``, and the stream checker checks each wait).
"""

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.optim.host_arena import ALLOCATOR, PageLockError, host_buffers
from torchtune_offload.optim.overlap import register_module_waits
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.state_plan import (
    Layout, Plan, cached_layout, check_created, describe_mismatch, largest_slice_bytes, layout_mismatch,
    placed_scalar, plan_state_bytes, slice_bytes, slice_plan, staged_views, unit_of)
from torchtune_offload.optim.step_together import runs, step_together
from torchtune_offload.optim.transfer import TransferEngine

def allocate_host_states(plans: Dict[int, Plan], *, pinning: str) -> Tuple[Dict[int, Dict[str, torch.Tensor]], str]:
    """Every streamed slot's array states, each at a page boundary, in one block per dtype
    (``torch.save`` refuses views of one storage as different dtypes: 8-bit codes and their fp32
    absmax go in two blocks). Returns them by slot and key, and the pinning they got."""
    specs = [(index, key, shape, dtype) for index, plan in plans.items() for key, shape, dtype in plan.layout]

    def carve(pinning: str) -> List[torch.Tensor]:
        made: Dict[Tuple[int, str], torch.Tensor] = {}
        for dtype in dict.fromkeys(spec[3] for spec in specs):
            members = [spec for spec in specs if spec[3] == dtype]
            buffers = host_buffers([(shape, dtype) for _, _, shape, _ in members], pinning=pinning)
            made.update(((index, key), tensor) for (index, key, _, _), tensor in zip(members, buffers))
        return [made[(index, key)] for index, key, _, _ in specs]

    try:
        made = carve(pinning)
    except PageLockError as err:
        warnings.warn(f"host memory could not be page-locked in place ({err}); pinning each state buffer with "
                      "torch's allocator instead, which rounds it up to a power of two", stacklevel=4)
        pinning = ALLOCATOR
        made = carve(pinning)
    host: Dict[int, Dict[str, torch.Tensor]] = {index: {} for index in plans}
    for (index, key, _, _), tensor in zip(specs, made):
        host[index][key] = tensor
    return host, pinning


class StateStreamer:
    """The only writer of the streamed slots' host states, the staging buffers and the queue of
    device updates.

    Args:
        table: the slots (built with ``update_on="device"``).
        transfer: copies and their timings.
        staging_bytes: the bound on the device staging area (two buffers of half of it).
        overlap: run updates in the next forward's order, with forward waits (see module docs).

    Raises:
        ValueError: if a base optimizer's state cannot be planned, or the bound is too small.
    """

    def __init__(self, table: ParameterTable, transfer: TransferEngine, *,
                 staging_bytes: int, overlap: bool) -> None:
        self._table = table
        self._transfer = transfer
        self.overlap = overlap
        self._plans: Dict[int, Plan] = {}
        cache: Dict[tuple, Tuple[Layout, List[str]]] = {}
        for slot in table.streamed:
            cls = type(slot.optimizer)
            layout = cached_layout(cache, cls, table.group_options[slot.group_index], slot.param,
                                    group=slot.group_index)
            self._plans[slot.index] = slice_plan(slot.key, cls, slot.param, *layout, staging_bytes // 2)
        self._host, self.pinning = allocate_host_states(self._plans, pinning=table.pinning)
        self._initialised = {index: self._adopt_constructed_states(table.slots[index]) for index in self._plans}
        # bitsandbytes' kernels ignore torch's current stream: its updates are never moved to a side stream.
        self._side_stream_safe = all(capabilities_of(type(s.optimizer)).kernels_on_current_stream for s in table.streamed)
        largest = largest_slice_bytes(list(self._plans.values()))
        device = transfer.device
        # Two buffers, each as large as the largest slice needs and never above half the bound.
        self._buffers = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(2 if largest else 0)]
        # Uploads, downloads, and (with overlap) the queued updates each have a stream.
        self._streams = transfer.order
        self._up = self._streams.new_stream()
        self._down = self._streams.new_stream()
        self._update_stream = self._streams.new_stream()
        for stream in (self._up, self._down, self._update_stream):
            for buffer in self._buffers:
                # Freed with the streamer, the buffers wait for every side stream's use of them.
                self._streams.keep_for(buffer, stream)
        # Allocated on the compute stream: the first upload (of a slot whose base optimizer made its
        # states in its constructor, Adagrad's) must not write the buffers before that is done.
        self._streams.wait_stream(self._up, self._streams.current())
        self._buffer_free: List[Optional[object]] = [None, None]
        self._views = _Views(self._plans, self._buffers, self._host)
        # The module whose forward waits for each slot (its runs stay within it).
        self._units = {slot.index: unit_of(slot.key) for slot in table.streamed}
        self._downloaded: Dict[int, Optional[object]] = {}
        self._next_buffer = 0
        # Queued updates (overlap with forward waits): slot index -> the event that ends its update.
        self._pending: Dict[int, Any] = {}
        self._order: Dict[int, int] = {}
        self.forward_waits = False
        self._hooks: List[Any] = []

    # ------------------------------------------------------------------------- memory

    def _adopt_constructed_states(self, slot: Slot) -> bool:
        """Moves array states the base optimizer made in its constructor (Adagrad's ``sum``) into
        the host buffers, freeing their device copies. Returns whether the slot has states now."""
        state = slot.optimizer.state.get(slot.param)
        if not state:
            return False
        plan = self._plans[slot.index]
        mismatch = layout_mismatch(plan.layout, state)
        if mismatch:
            raise RuntimeError(f"{slot.key}: {type(slot.optimizer).__name__}'s constructor made states its meta probe "
                               f"did not plan ({describe_mismatch(mismatch)}); use optimizer.update_on=host with it.")
        with torch.no_grad():
            for key, _, _ in plan.layout:
                self._host[slot.index][key].copy_(state[key])
        state.update({key: self._host[slot.index][key] for key, _, _ in plan.layout})
        return True

    @property
    def host_bytes(self) -> int:
        """Host bytes of the states, as allocated."""
        return sum(plan_state_bytes(plan.layout, pinning=self.pinning) for plan in self._plans.values())

    @property
    def state_bytes(self) -> int:
        """Bytes of the streamed states themselves (what the device is spared)."""
        return sum(t.numel() * t.element_size() for states in self._host.values() for t in states.values())

    @property
    def device_staging_bytes(self) -> int:
        """Device bytes of the staging buffers (at most the bound)."""
        return sum(b.numel() for b in self._buffers)

    def slices(self, slot: Slot) -> List[Tuple[int, int]]:
        """The slices ``(start, stop)`` the slot is staged in (one when staged whole)."""
        return list(self._plans[slot.index].slices)

    # ------------------------------------------------------------------------- the update

    def _run(self, slot: Slot, grad: torch.Tensor, stream: object) -> Optional[object]:
        """Updates ``slot`` on the device with ``grad``, slice by slice, on ``stream`` (the compute
        or update stream). Returns the event that ends its last update."""
        plan = self._plans[slot.index]
        opt = slot.optimizer
        param = slot.param
        host_state = opt.state.get(param, {})
        scalars = {k: host_state[k] for k in plan.scalars if k in host_state}
        # The previous step's downloads of this slot must be in host memory before uploads read it.
        self._streams.wait_event(self._up, self._downloaded.get(slot.index))
        computed, new_scalars, done = None, scalars, False
        try:
            last = len(plan.slices) - 1
            for i, (start, stop) in enumerate(plan.slices):
                computed, new_scalars = self._run_slice(slot, grad, stream, start, stop, scalars, last=i == last)
            done = True
        finally:
            # Whatever happened, the base optimizer steps the parameter and keeps the host states
            # (a failed step keeps the scalars it had, as far as the base optimizer left them, so
            # state_dict() never saves staging memory).
            opt.param_groups[0]["params"] = [param]
            opt.state.clear()
            if done or self._initialised[slot.index]:
                opt.state[param] = {**{k: self._host[slot.index][k] for k, _, _ in plan.layout},
                                    **(new_scalars if done else scalars)}
        self._initialised[slot.index] = True
        return computed

    def _run_slice(self, slot: Slot, grad: torch.Tensor, stream: object, start: int, stop: int,
                   scalars: Dict[str, Any], *, last: bool) -> Tuple[Optional[object], Dict[str, Any]]:
        """One slice of :meth:`_run`: upload, update, download. Returns the update's event and the
        scalar states after it."""
        plan = self._plans[slot.index]
        opt = slot.optimizer
        initialised = self._initialised[slot.index]
        order = self._streams
        staged: Dict[str, torch.Tensor] = {}
        index = None
        if plan.layout:  # a base optimizer without array states (SGD without momentum) stages nothing
            index = self._next_buffer
            self._next_buffer ^= 1
            staged = self._views.staged(index, slot, start, stop)
            order.wait_event(self._up, self._buffer_free[index])
            if not initialised:
                # A slot's first step writes the buffer on the update's own stream, with no
                # upload to order it after the download that last read this buffer.
                order.wait_event(stream, self._buffer_free[index])
        host = self._views.host(slot, start, stop)
        if initialised and staged:
            uploaded = self._transfer.timed_copies(list(staged.values()), [host[k] for k in staged],
                                                   kind="state_up", stream=self._up)
            order.wait_event(stream, uploaded)
        view = self._views.param(slot, start, stop)
        view.grad = grad if plan.whole else grad.view(-1)[start:stop]
        with order.on(stream):
            # Every slice starts from the scalars before the step (each takes one step): the last
            # from the slot's own, which the base optimizer advances in place as plain training does.
            state = dict(scalars) if last else self._views.spare_scalars(slot, scalars)
            if initialised:
                state.update(staged)
            opt.param_groups[0]["params"] = [view]
            opt.state.clear()
            if state:
                opt.state[view] = state
            try:
                opt.step()
            finally:
                view.grad = None
            result = opt.state[view]
            if not initialised:
                check_created(slot, plan, result, start, stop)
                # The states the first step created go through the staging buffer too, and are
                # freed on this stream right away: the device never holds more than one slice of them.
                for key, target in staged.items():
                    target.copy_(result[key])
            computed = order.record(stream)
        new_scalars = {k: result[k] for k in plan.scalars if k in result}
        if index is not None:
            self._download([slot], list(staged.values()), [host[k] for k in staged], index=index, computed=computed)
        return computed, new_scalars

    def _download(self, slots: List[Slot], staged: List[torch.Tensor], host: List[torch.Tensor], *, index: int,
                  computed: object) -> None:
        """Copies states from staging buffer ``index`` back to host memory once their update (the
        event ``computed``) is done; the buffer is free again when the copies are."""
        order = self._streams
        order.wait_event(self._down, computed)
        freed = self._transfer.timed_copies(host, staged, kind="state_down", stream=self._down)
        self._buffer_free[index] = freed
        for slot in slots:
            self._downloaded[slot.index] = freed

    # --------------------------------------------------------------- batches of whole slots

    def _batch_key(self, slot: Slot) -> Optional[tuple]:
        """What slots stepped together share, or None where the slot is stepped alone: a slot that
        has its states, staged in one slice of an elementwise update, goes with its neighbours of
        the same optimizer class, parameter group (the same options) and module
        (``state_plan.unit_of``, so that no module's forward waits for another's update)."""
        plan = self._plans[slot.index]
        if plan.whole or len(plan.slices) != 1 or not self._initialised[slot.index]:
            return None
        return type(slot.optimizer), slot.group_index, self._units[slot.index]

    def _batches(self, slots: List[Slot]) -> List[List[Slot]]:
        """``slots`` in runs, in their order, each run stepped at once: consecutive slots of one
        :meth:`_batch_key` whose states fit one staging buffer together, or one slot alone."""
        capacity = self._buffers[0].numel() if self._buffers else 0
        return runs(slots, key=self._batch_key, nbytes=lambda slot: self._views.run_bytes[slot.index], bound=capacity)

    def _run_batch(self, slots: List[Slot], stream: object) -> Optional[object]:
        """Updates ``slots`` (one of :meth:`_batches`) on ``stream``; returns the event that ends it.

        A run of whole slots goes through one staging buffer together: one upload of all their
        states, one step of the first slot's base optimizer over all their parameters (torch's
        optimizers step the tensors of a group one by one, or in one multi-tensor kernel where
        they default to it, the arithmetic of each tensor its own), one download."""
        if self._batch_key(slots[0]) is None:
            (slot,) = slots
            return self._run(slot, slot.param.grad, stream)
        order = self._streams
        index = self._next_buffer
        self._next_buffer ^= 1
        staged = self._views.run(index, slots)
        for slot in slots:
            # The previous step's downloads of these slots must be in host memory before uploads read them.
            self._streams.wait_event(self._up, self._downloaded.get(slot.index))
        order.wait_event(self._up, self._buffer_free[index])
        targets = [view for views in staged for view in views.values()]
        sources = [self._host[s.index][k] for s, views in zip(slots, staged) for k in views]
        uploaded = self._transfer.timed_copies(targets, sources, kind="state_up", stream=self._up)
        order.wait_event(stream, uploaded)
        own = [s.optimizer.state[s.param] for s in slots]  # host states and scalars
        with order.on(stream):
            # One call of the first slot's optimizer, each parameter on its scalars and staged arrays.
            stepped = step_together(slots[0].optimizer, [s.param for s in slots],
                                    [{**state, **views} for state, views in zip(own, staged)])
            # Scalar states advanced in place are the slots' own; one the base optimizer replaced
            # (a Python number) is written back.
            for slot, state, after in zip(slots, own, stepped):
                for k in self._plans[slot.index].scalars:
                    if k in after and after[k] is not state.get(k):
                        state[k] = after[k]
            computed = order.record(stream)
        self._download(slots, targets, sources, index=index, computed=computed)
        return computed

    # -------------------------------------------------------------------------- queueing

    def update(self, slots: List[Slot]) -> None:
        """Updates the streamed ``slots`` (those with a gradient; what was queued before must be
        finished, as ``OffloadOptimizer.step`` does first) now, or queues those a
        registered module's forward waits for (``overlap`` with forward waits; on an accelerator
        only for base optimizers whose kernels run on torch's current stream)."""
        queue = self.overlap and self.forward_waits and self._side_stream_safe
        # Every step stages its runs in the same buffers: their views, made once, serve every step.
        self._next_buffer = 0
        queued = sorted((s for s in slots if queue and s.index in self._order), key=lambda s: self._order[s.index])
        waiting = {s.index for s in queued}
        # What nothing would wait for: now, on the compute stream.
        for run in self._batches([s for s in slots if s.index not in waiting]):
            self._run_batch(run, self._streams.current())
        if queued:
            # The updates run on a side stream, in the next forward's order.
            self._streams.wait_stream(self._update_stream, self._streams.current())
        for slot in queued:
            grad = slot.param.grad
            self._streams.keep_for(grad, self._update_stream)
        for run in self._batches(queued):
            done = self._run_batch(run, self._update_stream)
            for slot in run:
                self._pending[slot.index] = done

    def wait(self, slots: Sequence[Slot]) -> None:
        """Orders what comes next on the compute stream after the queued updates of ``slots``."""
        for slot in slots:
            if slot.index in self._pending:
                self._streams.wait_event(self._streams.current(), self._pending.pop(slot.index))

    def wait_pending(self) -> None:
        """Orders what comes next on the compute stream after every queued update."""
        self.wait([self._table.slots[index] for index in sorted(self._pending, key=lambda i: self._order[i])])

    def synchronize(self) -> None:
        """Finishes every queued update, and waits until the states are back in host memory."""
        self.wait_pending()
        self._streams.host_waits_stream(self._down)

    def register_forward_waits(self, model: torch.nn.Module, *, units: Optional[Sequence[Any]] = None) -> None:
        """Each module of ``model`` waits, right before its forward, for its own parameters'
        updates, which are queued in the order of these modules; ``model.state_dict()`` waits for all.
        ``units``: the modules that wait instead, as ``overlap.register_module_waits`` takes them."""
        def own(param: torch.nn.Parameter) -> Optional[Slot]:
            slot = self._table.slot_of.get(param)
            return slot if slot is not None and slot.streamed else None

        handles, ordered = register_module_waits(model, own, self.wait, self.synchronize, units=units)
        self._hooks.extend(handles)
        for slot in ordered:
            self._order.setdefault(slot.index, len(self._order))
        self.forward_waits = True

    # ---------------------------------------------------------------------- checkpoints

    def load(self, slot: Slot, saved: Dict[str, Any]) -> None:
        """Restores one streamed slot from its base optimizer's ``state_dict``: the array states
        into the host buffers, the rest through the base optimizer's own loader. States saved as
        plain tensors (torch's optimizers, ``AdamW8bit``) are copied in directly, with no device
        copy; a format that packs them (bitsandbytes' quantisation state) goes through the base
        optimizer's loader first, one tensor's states on the device at a time.

        Raises:
            ValueError: if the loaded states are not those the host buffers were planned for.
        """
        plan = self._plans[slot.index]
        states = saved.get("state", {})
        arrays = next(iter(states.values()), {}) if states else {}
        planned = [key for key, _, _ in plan.layout]
        if arrays and not all(key in arrays for key in planned):
            slot.optimizer.load_state_dict(saved)
            arrays = dict(slot.optimizer.state[slot.param])
            problem = self._layout_problem(slot, arrays)
            if problem:
                raise ValueError(f"optimizer checkpoint does not fit this optimizer: {problem}")
        else:
            # The hyper-parameters through the base optimizer's loader; the states by hand (its
            # loader would move them to the parameter's device).
            slot.optimizer.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
            group = slot.optimizer.param_groups[0]
            slot.optimizer.state[slot.param] = {k: placed_scalar(v, slot.param, group)
                                                for k, v in arrays.items() if k not in planned}
        if not arrays:
            self._initialised[slot.index] = False
            slot.optimizer.state.clear()
            return
        with torch.no_grad():
            for key in planned:
                self._host[slot.index][key].copy_(arrays[key])
        slot.optimizer.state[slot.param].update({key: self._host[slot.index][key] for key in planned})
        self._initialised[slot.index] = True

    def _layout_problem(self, slot: Slot, arrays: Dict[str, Any]) -> Optional[str]:
        mismatch = layout_mismatch(self._plans[slot.index].layout, arrays)
        if mismatch is None:
            return None
        key, found, planned = mismatch
        return f"{slot.key}: state {key!r} is {found} in the checkpoint, {planned} here"

    def load_problem(self, slot: Slot, saved: Dict[str, Any]) -> Optional[str]:
        """Why ``saved`` (a base optimizer ``state_dict``) cannot be loaded into ``slot``, or None
        (a format that packs its states is checked once its own loader has unpacked them)."""
        states = saved.get("state", {}) if isinstance(saved, dict) else {}
        if not states:
            return None
        arrays = next(iter(states.values()))
        if any(isinstance(v, dict) for v in arrays.values()):
            # A packed format (bitsandbytes'): unpacked by its own loader into a throwaway optimizer
            # over a meta parameter, so that nothing is loaded before every slot is checked.
            probe = torch.nn.Parameter(torch.empty(slot.param.shape, dtype=slot.param.dtype, device="meta"))
            try:
                throwaway = type(slot.optimizer)([probe], **self._table.group_options[slot.group_index])
                throwaway.load_state_dict(saved)
            except Exception as err:  # any loader may refuse a checkpoint: say which slot and why
                return f"{slot.key}: its {type(slot.optimizer).__name__} state could not be read ({err})"
            arrays = dict(throwaway.state[probe])
        return self._layout_problem(slot, arrays)

    def close(self) -> None:
        """Finishes queued updates and removes the forward waits."""
        try:
            self.synchronize()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            self.forward_waits = False


class _Views:
    """The views :class:`StateStreamer`'s updates stage, step and copy through, each made once (a
    view kept costs the launching thread no op): a slice's or a run's states in a staging buffer, a
    slice of a slot's host states and of its parameter, and the scalars a slot's slices but its last
    start from."""

    def __init__(self, plans: Dict[int, Plan], buffers: List[torch.Tensor],
                 host: Dict[int, Dict[str, torch.Tensor]]) -> None:
        self._plans = plans
        self._buffers = buffers
        self._host = host
        self._staged: Dict[Tuple[int, int, int, int], Dict[str, torch.Tensor]] = {}
        self._runs: Dict[Tuple[int, Tuple[int, ...]], List[Dict[str, torch.Tensor]]] = {}
        self._host_slices: Dict[Tuple[int, int, int], Dict[str, torch.Tensor]] = {}
        self._params: Dict[Tuple[int, int, int], torch.Tensor] = {}
        self._spares: Dict[int, Dict[str, torch.Tensor]] = {}
        #: Each slot's staging bytes in a run (all of its states, whole).
        self.run_bytes = {index: slice_bytes(plan, 0, plan.slices[-1][1]) for index, plan in plans.items()}

    def staged(self, index: int, slot: Slot, start: int, stop: int) -> Dict[str, torch.Tensor]:
        """One slice's states in staging buffer ``index``."""
        key = (index, slot.index, start, stop)
        if key not in self._staged:
            self._staged[key] = staged_views(self._buffers[index], self._plans[slot.index], start, stop)
        return self._staged[key]

    def run(self, index: int, slots: List[Slot]) -> List[Dict[str, torch.Tensor]]:
        """The states of a run of whole slots in staging buffer ``index``, one after the other,
        each shaped as the slot's own."""
        key = (index, tuple(s.index for s in slots))
        if key not in self._runs:
            views, offset = [], 0
            for slot in slots:
                views.append(staged_views(self._buffers[index], self._plans[slot.index], 0, slot.param.numel(),
                                          offset=offset, shaped=True))
                offset += self.run_bytes[slot.index]
            self._runs[key] = views
        return self._runs[key]

    def host(self, slot: Slot, start: int, stop: int) -> Dict[str, torch.Tensor]:
        """The slot's host states over one slice."""
        key = (slot.index, start, stop)
        if key not in self._host_slices:
            whole = self._plans[slot.index].whole
            self._host_slices[key] = {k: t if whole else t.view(-1)[start:stop]
                                      for k, t in self._host[slot.index].items()}
        return self._host_slices[key]

    def param(self, slot: Slot, start: int, stop: int) -> torch.Tensor:
        """What the base optimizer steps for one slice: a detached view of the parameter."""
        key = (slot.index, start, stop)
        if key not in self._params:
            param = slot.param.detach()
            self._params[key] = param if self._plans[slot.index].whole else param.view(-1)[start:stop]
        return self._params[key]

    def spare_scalars(self, slot: Slot, scalars: Dict[str, Any]) -> Dict[str, Any]:
        """A copy of the slot's scalar states, its tensors copied into buffers made once (on the
        current stream: a fused kernel's step count is a device tensor)."""
        spares = self._spares.setdefault(slot.index, {})
        out = {}
        for key, value in scalars.items():
            if isinstance(value, torch.Tensor):
                if key not in spares:
                    spares[key] = torch.empty_like(value)
                value = spares[key].copy_(value)
            out[key] = value
        return out
