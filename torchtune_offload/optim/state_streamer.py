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
from torchtune_offload.optim.host_arena import ALLOCATOR, PageLockError, buffer_bytes, host_buffers
from torchtune_offload.optim.host_buffers import probe_state
from torchtune_offload.optim.overlap import register_module_waits
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.transfer import TransferEngine

#: Slices are whole multiples of this many elements (2 KiB of fp32, a multiple of any vector width).
SLICE_ELEMENTS = 512
#: Each staged state starts at a multiple of this many bytes of its staging buffer.
STAGING_ALIGNMENT = 256


def _staged_bytes(numel: int, dtype: torch.dtype) -> int:
    return -(-numel * dtype.itemsize // STAGING_ALIGNMENT) * STAGING_ALIGNMENT


#: ``(key, shape, dtype)`` of each array state of a slot, in the base optimizer's order.
Layout = List[Tuple[str, torch.Size, torch.dtype]]


def state_layout(cls: type, options: Dict[str, Any], param: torch.Tensor) -> Tuple[Layout, List[str]]:
    """The array states (``(key, shape, dtype)``) and the scalar state keys optimizer ``cls``
    built with ``options`` keeps for ``param``, probed on meta tensors.

    Raises:
        ValueError: if the optimizer cannot step on meta tensors (its states then cannot be
            planned before they exist).
    """
    try:
        state = probe_state(cls, param.shape, param.dtype, options)
    except Exception as err:  # any optimizer may fail on meta tensors; say which and why
        raise ValueError(
            f"optimizer.update_on=device: {cls.__name__}'s state could not be sized on meta tensors "
            f"({type(err).__name__}: {err}), so its host buffers cannot be planned. Use optimizer.update_on=host."
        ) from None
    arrays = [(k, v.shape, v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
    scalars = [k for k in state if k not in {a[0] for a in arrays}]
    return arrays, scalars


def cached_layout(cache: Dict[tuple, Tuple[Layout, List[str]]], cls: type, options: Dict[str, Any],
                   param: torch.Tensor, *, group: int = 0) -> Tuple[Layout, List[str]]:
    """:func:`state_layout`, probed once per optimizer class, parameter group (its options can
    change the states: amsgrad, momentum), shape and dtype."""
    key = (cls, group, param.shape, param.dtype)
    if key not in cache:
        cache[key] = state_layout(cls, options, param)
    return cache[key]


def plan_state_bytes(layout: Layout, *, pinning: str) -> int:
    """Host bytes of one slot's array states as :class:`StateStreamer` allocates them."""
    return sum(buffer_bytes(int(torch.Size(shape).numel()) * dtype.itemsize, pinning=pinning)
               for _, shape, dtype in layout)


class _Plan:
    """How one streamed slot is staged: its layout, and its slices ``(start, stop)`` in elements
    (one slice of the whole tensor when staged whole)."""

    __slots__ = ("layout", "scalars", "whole", "slices")

    def __init__(self, layout: Layout, scalars: List[str], *, whole: bool, slices: List[Tuple[int, int]]) -> None:
        self.layout = layout
        self.scalars = scalars
        self.whole = whole
        self.slices = slices


def slice_plan(key: str, cls: type, param: torch.Tensor, layout: Layout, scalars: List[str],
                half_bytes: int) -> _Plan:
    """Slices of parameter ``key`` (stepped by ``cls``) that fit one staging buffer of ``half_bytes``.

    Raises:
        ValueError: naming ``optimizer.device_staging_mib`` if one buffer cannot hold what must
            be staged at once.
    """
    numel = param.numel()
    elementwise = (capabilities_of(cls).elementwise_update and param.is_contiguous()
                   and all(torch.Size(shape).numel() == numel for _, shape, _ in layout))
    padding = STAGING_ALIGNMENT * len(layout)
    if not elementwise:
        if not capabilities_of(cls).elementwise_update:
            why_whole = "its update is not declared elementwise"
        elif not param.is_contiguous():
            why_whole = "the parameter is not contiguous"
        else:
            why_whole = "its states are not shaped like the parameter"
        need = sum(_staged_bytes(torch.Size(s).numel(), d) for _, s, d in layout)
        if need > half_bytes:
            raise ValueError(
                f"optimizer.device_staging_mib: {key}'s {cls.__name__} states are staged "
                f"whole ({need / 2**20:.3g} MiB; {why_whole}), but one of the two staging buffers "
                f"holds {half_bytes / 2**20:.3g} MiB. Set optimizer.device_staging_mib to at least "
                f"{2 * need / 2**20:.3g}, or optimizer.update_on=host."
            )
        return _Plan(layout, scalars, whole=True, slices=[(0, numel)])
    per_element = sum(d.itemsize for _, _, d in layout)
    if not per_element:  # no array state (SGD without momentum): the update needs no staging
        return _Plan(layout, scalars, whole=True, slices=[(0, numel)])
    span = (half_bytes - padding) // per_element // SLICE_ELEMENTS * SLICE_ELEMENTS
    if span <= 0:
        raise ValueError(
            f"optimizer.device_staging_mib: a staging buffer of {half_bytes} bytes cannot hold one slice of "
            f"{SLICE_ELEMENTS} elements of {key}'s states ({per_element} bytes each). Set "
            f"optimizer.device_staging_mib to at least {2 * (SLICE_ELEMENTS * per_element + padding) / 2**20:.3g}."
        )
    return _Plan(layout, scalars, whole=False, slices=[(a, min(a + span, numel)) for a in range(0, numel, span)])


def _slice_bytes(plan: _Plan, start: int, stop: int) -> int:
    """Staging bytes of one slice: each state at an aligned offset."""
    if plan.whole:
        return sum(_staged_bytes(torch.Size(s).numel(), d) for _, s, d in plan.layout)
    return sum(_staged_bytes(stop - start, d) for _, _, d in plan.layout)


def largest_slice_bytes(plans: List[_Plan]) -> int:
    return max((_slice_bytes(plan, a, b) for plan in plans for a, b in plan.slices), default=0)


def _layout_mismatch(layout: Layout, state: Dict[str, Any]) -> Optional[Tuple[str, str, str]]:
    """The first state of ``layout`` that ``state`` lacks or holds in another shape or dtype, as
    ``(key, what state holds, what the layout plans)``; None if all match."""
    for key, shape, dtype in layout:
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or value.shape != torch.Size(shape) or value.dtype != dtype:
            found = f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor) else "missing"
            return key, found, f"{dtype}{list(shape)}"
    return None


def _describe(mismatch: Tuple[str, str, str]) -> str:
    key, found, planned = mismatch
    return f"state {key!r} is {found}, {planned} planned"


def _check_created(slot: Slot, plan: _Plan, state: Dict[str, Any], start: int, stop: int) -> None:
    """The states the base optimizer created at its first step are those planned from the probe
    (never copied into buffers of another size or dtype)."""
    planned = {key for key, _, _ in plan.layout}
    extra = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in planned]
    layout = plan.layout if plan.whole else [(k, torch.Size([stop - start]), d) for k, _, d in plan.layout]
    mismatch = _layout_mismatch(layout, state)
    problem = f"created states {extra} it did not plan" if extra else mismatch and _describe(mismatch)
    if problem:
        raise RuntimeError(f"{slot.key}: {type(slot.optimizer).__name__} {problem} (by its probe on meta tensors); "
                           "its states depend on more than its options, shape and dtype. Use "
                           "optimizer.update_on=host with it.")


def _placed_scalar(value: Any, param: torch.Tensor, group: Dict[str, Any]) -> Any:
    """A loaded scalar state where torch's optimizers keep it: a step count on the parameter's
    device for fused or capturable kernels, else on the host, as saved."""
    if not isinstance(value, torch.Tensor):
        return value
    if group.get("fused") or group.get("capturable"):
        return value.to(device=param.device, dtype=torch.float32)
    return value.clone()


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
        self._plans: Dict[int, _Plan] = {}
        cache: Dict[tuple, Tuple[Layout, List[str]]] = {}
        for slot in table.streamed:
            cls = type(slot.optimizer)
            layout = cached_layout(cache, cls, table.group_options[slot.group_index], slot.param,
                                    group=slot.group_index)
            self._plans[slot.index] = slice_plan(slot.key, cls, slot.param, *layout, staging_bytes // 2)
        self.pinning = table.pinning
        self._host = self._allocate_host_states()
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
        self._buffer_free: List[Optional[object]] = [None, None]
        # (buffer, slot, slice) -> the slice's staged views of its states in that buffer.
        self._views: Dict[Tuple[int, int, int, int], Dict[str, torch.Tensor]] = {}
        self._downloaded: Dict[int, Optional[object]] = {}
        self._next_buffer = 0
        # Queued updates (overlap with forward waits): slot index -> the event that ends its update.
        self._pending: Dict[int, Any] = {}
        self._order: Dict[int, int] = {}
        self.forward_waits = False
        self._hooks: List[Any] = []

    # ------------------------------------------------------------------------- memory

    def _allocate_host_states(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """Every streamed slot's array states, each at a page boundary, in one block per dtype
        (``torch.save`` refuses views of one storage as different dtypes: 8-bit codes and their
        fp32 absmax go in two blocks)."""
        specs = [(index, key, shape, dtype) for index, plan in self._plans.items() for key, shape, dtype in plan.layout]
        try:
            made = self._carve(specs)
        except PageLockError as err:
            warnings.warn(f"host memory could not be page-locked in place ({err}); pinning each state buffer with "
                          "torch's allocator instead, which rounds it up to a power of two", stacklevel=4)
            self.pinning = ALLOCATOR
            made = self._carve(specs)
        host: Dict[int, Dict[str, torch.Tensor]] = {index: {} for index in self._plans}
        for (index, key, _, _), tensor in zip(specs, made):
            host[index][key] = tensor
        return host

    def _carve(self, specs: List[Tuple[int, str, torch.Size, torch.dtype]]) -> List[torch.Tensor]:
        made: Dict[Tuple[int, str], torch.Tensor] = {}
        for dtype in dict.fromkeys(spec[3] for spec in specs):
            members = [spec for spec in specs if spec[3] == dtype]
            for (index, key, _, _), tensor in zip(members, host_buffers([(shape, dtype) for _, _, shape, _ in members],
                                                                         pinning=self.pinning)):
                made[(index, key)] = tensor
        return [made[(index, key)] for index, key, _, _ in specs]

    def _adopt_constructed_states(self, slot: Slot) -> bool:
        """Moves array states the base optimizer made in its constructor (Adagrad's ``sum``) into
        the host buffers, freeing their device copies. Returns whether the slot has states now."""
        state = slot.optimizer.state.get(slot.param)
        if not state:
            return False
        plan = self._plans[slot.index]
        mismatch = _layout_mismatch(plan.layout, state)
        if mismatch:
            raise RuntimeError(f"{slot.key}: {type(slot.optimizer).__name__}'s constructor made states its meta probe "
                               f"did not plan ({_describe(mismatch)}); use optimizer.update_on=host with it.")
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

    def _staged_views(self, buffer: torch.Tensor, plan: _Plan, start: int, stop: int) -> Dict[str, torch.Tensor]:
        views, offset = {}, 0
        for key, shape, dtype in plan.layout:
            numel = torch.Size(shape).numel() if plan.whole else stop - start
            view = buffer[offset:offset + numel * dtype.itemsize].view(dtype)
            views[key] = view.view(shape) if plan.whole else view
            offset += _staged_bytes(numel, dtype)
        return views

    def _host_slice(self, slot: Slot, key: str, start: int, stop: int) -> torch.Tensor:
        tensor = self._host[slot.index][key]
        return tensor if self._plans[slot.index].whole else tensor.view(-1)[start:stop]

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
            for start, stop in plan.slices:
                computed, new_scalars = self._run_slice(slot, grad, stream, start, stop, scalars)
            done = True
        finally:
            # Whatever happened, the base optimizer steps the parameter and keeps the host states
            # (a failed step keeps the scalars it had, so state_dict() never saves staging memory).
            opt.param_groups[0]["params"] = [param]
            opt.state.clear()
            if done or self._initialised[slot.index]:
                opt.state[param] = {**{k: self._host[slot.index][k] for k, _, _ in plan.layout},
                                    **(new_scalars if done else scalars)}
        self._initialised[slot.index] = True
        return computed

    def _run_slice(self, slot: Slot, grad: torch.Tensor, stream: object, start: int, stop: int,
                   scalars: Dict[str, Any]) -> Tuple[Optional[object], Dict[str, Any]]:
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
            key = (index, slot.index, start, stop)
            staged = self._views.get(key)
            if staged is None:  # made once: a view kept costs the launching thread no op
                staged = self._views[key] = self._staged_views(self._buffers[index], plan, start, stop)
            order.wait_event(self._up, self._buffer_free[index])
            if not initialised:
                # A slot's first step writes the buffer on the update's own stream, with no
                # upload to order it after the download that last read this buffer.
                order.wait_event(stream, self._buffer_free[index])
        if initialised:
            uploaded = None
            for key, view in staged.items():
                uploaded = self._transfer.timed_copy(view, self._host_slice(slot, key, start, stop),
                                                     kind="state_up", stream=self._up)
            order.wait_event(stream, uploaded)
        view = slot.param.detach() if plan.whole else slot.param.detach().view(-1)[start:stop]
        view.grad = grad if plan.whole else grad.view(-1)[start:stop]
        with order.on(stream):
            # Every slice starts from the scalars before the step (each takes one step); a scalar
            # on the device (a fused kernel's step count) is copied on the update's stream.
            state = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
            if initialised:
                state.update(staged)
            opt.param_groups[0]["params"] = [view]
            opt.state.clear()
            if state:
                opt.state[view] = state
            opt.step()
            result = opt.state[view]
            if not initialised:
                _check_created(slot, plan, result, start, stop)
                # The states the first step created go through the staging buffer too, and are
                # freed on this stream right away: the device never holds more than one slice of them.
                for key, target in staged.items():
                    target.copy_(result[key])
            computed = order.record(stream)
        view.grad = None
        new_scalars = {k: result[k] for k in plan.scalars if k in result}
        if index is not None:
            self._download(slot, staged, index=index, computed=computed, start=start, stop=stop)
        return computed, new_scalars

    def _download(self, slot: Slot, staged: Dict[str, torch.Tensor], *, index: int, computed: object, start: int,
                  stop: int) -> None:
        """Copies one slice's states from staging buffer ``index`` back to host memory once its update
        (the event ``computed``) is done; the buffer is free again when the last copy is."""
        order = self._streams
        order.wait_event(self._down, computed)
        freed = None
        for key, target in staged.items():
            freed = self._transfer.timed_copy(self._host_slice(slot, key, start, stop), target,
                                              kind="state_down", stream=self._down)
        self._buffer_free[index] = freed
        self._downloaded[slot.index] = freed

    # -------------------------------------------------------------------------- queueing

    def update(self, slots: List[Slot]) -> None:
        """Updates the streamed ``slots`` (those with a gradient; what was queued before must be
        finished, as ``OffloadOptimizer.step`` does first) now, or queues those a
        registered module's forward waits for (``overlap`` with forward waits; on an accelerator
        only for base optimizers whose kernels run on torch's current stream)."""
        queue = self.overlap and self.forward_waits and self._side_stream_safe
        queued = sorted((s for s in slots if queue and s.index in self._order), key=lambda s: self._order[s.index])
        waiting = {s.index for s in queued}
        for slot in slots:
            if slot.index not in waiting:  # nothing would wait for it: now, on the compute stream
                self._run(slot, slot.param.grad, self._streams.current())
        if queued:
            # The updates run on a side stream, in the next forward's order.
            self._streams.wait_stream(self._update_stream, self._streams.current())
        for slot in queued:
            grad = slot.param.grad
            self._streams.keep_for(grad, self._update_stream)
            self._pending[slot.index] = self._run(slot, grad, self._update_stream)

    def wait(self, slot: Slot) -> None:
        """Orders what comes next on the compute stream after the slot's queued update."""
        if slot.index in self._pending:
            self._streams.wait_event(self._streams.current(), self._pending.pop(slot.index))

    def wait_pending(self) -> None:
        """Orders what comes next on the compute stream after every queued update."""
        for index in sorted(self._pending, key=lambda i: self._order[i]):
            self.wait(self._table.slots[index])

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
            slot.optimizer.state[slot.param] = {k: _placed_scalar(v, slot.param, group)
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
        mismatch = _layout_mismatch(self._plans[slot.index].layout, arrays)
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
