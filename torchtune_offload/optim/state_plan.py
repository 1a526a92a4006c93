"""How ``update_on="device"`` stages a streamed slot's states: their layout (probed on meta
tensors), the slices a slot is stepped in, and where each slice's states lie in a staging buffer
(``state_streamer.StateStreamer`` runs the updates; ``host_memory`` plans the same figures)."""

from typing import Any, Dict, List, Optional, Tuple

import torch

from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.optim.handoff import layer_prefix
from torchtune_offload.optim.host_arena import buffer_bytes
from torchtune_offload.optim.host_buffers import probe_state
from torchtune_offload.optim.param_table import Slot

#: Slices are whole multiples of this many elements (2 KiB of fp32, a multiple of any vector width).
SLICE_ELEMENTS = 512
#: Each staged state starts at a multiple of this many bytes of its staging buffer.
STAGING_ALIGNMENT = 256


def staged_bytes(numel: int, dtype: torch.dtype) -> int:
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


class Plan:
    """How one streamed slot is staged: its layout, and its slices ``(start, stop)`` in elements
    (one slice of the whole tensor when staged whole)."""

    __slots__ = ("layout", "scalars", "whole", "slices")

    def __init__(self, layout: Layout, scalars: List[str], *, whole: bool, slices: List[Tuple[int, int]]) -> None:
        self.layout = layout
        self.scalars = scalars
        self.whole = whole
        self.slices = slices


def slice_plan(key: str, cls: type, param: torch.Tensor, layout: Layout, scalars: List[str],
                half_bytes: int) -> Plan:
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
        need = sum(staged_bytes(torch.Size(s).numel(), d) for _, s, d in layout)
        if need > half_bytes:
            raise ValueError(
                f"optimizer.device_staging_mib: {key}'s {cls.__name__} states are staged "
                f"whole ({need / 2**20:.3g} MiB; {why_whole}), but one of the two staging buffers "
                f"holds {half_bytes / 2**20:.3g} MiB. Set optimizer.device_staging_mib to at least "
                f"{2 * need / 2**20:.3g}, or optimizer.update_on=host."
            )
        return Plan(layout, scalars, whole=True, slices=[(0, numel)])
    per_element = sum(d.itemsize for _, _, d in layout)
    if not per_element:  # no array state (SGD without momentum): the update needs no staging
        return Plan(layout, scalars, whole=True, slices=[(0, numel)])
    span = (half_bytes - padding) // per_element // SLICE_ELEMENTS * SLICE_ELEMENTS
    if span <= 0:
        raise ValueError(
            f"optimizer.device_staging_mib: a staging buffer of {half_bytes} bytes cannot hold one slice of "
            f"{SLICE_ELEMENTS} elements of {key}'s states ({per_element} bytes each). Set "
            f"optimizer.device_staging_mib to at least {2 * (SLICE_ELEMENTS * per_element + padding) / 2**20:.3g}."
        )
    return Plan(layout, scalars, whole=False, slices=[(a, min(a + span, numel)) for a in range(0, numel, span)])


def slice_bytes(plan: Plan, start: int, stop: int) -> int:
    """Staging bytes of one slice: each state at an aligned offset."""
    if plan.whole:
        return sum(staged_bytes(torch.Size(s).numel(), d) for _, s, d in plan.layout)
    return sum(staged_bytes(stop - start, d) for _, _, d in plan.layout)


def largest_slice_bytes(plans: List[Plan]) -> int:
    return max((slice_bytes(plan, a, b) for plan in plans for a, b in plan.slices), default=0)


def unit_of(key: str) -> str:
    """The module whose forward waits for parameter ``key``: a transformer layer (``...layers.<i>``)
    for the parameters inside it, as ``overlap.register_module_waits`` waits, else the parameter's
    own module."""
    return layer_prefix(key) or key.rpartition(".")[0]


def layout_mismatch(layout: Layout, state: Dict[str, Any]) -> Optional[Tuple[str, str, str]]:
    """The first state of ``layout`` that ``state`` lacks or holds in another shape or dtype, as
    ``(key, what state holds, what the layout plans)``; None if all match."""
    for key, shape, dtype in layout:
        value = state.get(key)
        if not isinstance(value, torch.Tensor) or value.shape != torch.Size(shape) or value.dtype != dtype:
            found = f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor) else "missing"
            return key, found, f"{dtype}{list(shape)}"
    return None


def describe_mismatch(mismatch: Tuple[str, str, str]) -> str:
    key, found, planned = mismatch
    return f"state {key!r} is {found}, {planned} planned"


def check_created(slot: Slot, plan: Plan, state: Dict[str, Any], start: int, stop: int) -> None:
    """The states the base optimizer created at its first step are those planned from the probe
    (never copied into buffers of another size or dtype)."""
    planned = {key for key, _, _ in plan.layout}
    extra = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and k not in planned]
    layout = plan.layout if plan.whole else [(k, torch.Size([stop - start]), d) for k, _, d in plan.layout]
    mismatch = layout_mismatch(layout, state)
    problem = f"created states {extra} it did not plan" if extra else mismatch and describe_mismatch(mismatch)
    if problem:
        raise RuntimeError(f"{slot.key}: {type(slot.optimizer).__name__} {problem} (by its probe on meta tensors); "
                           "its states depend on more than its options, shape and dtype. Use "
                           "optimizer.update_on=host with it.")


def placed_scalar(value: Any, param: torch.Tensor, group: Dict[str, Any]) -> Any:
    """A loaded scalar state where torch's optimizers keep it: a step count on the parameter's
    device for fused or capturable kernels, else on the host, as saved."""
    if not isinstance(value, torch.Tensor):
        return value
    if group.get("fused") or group.get("capturable"):
        return value.to(device=param.device, dtype=torch.float32)
    return value.clone()


def staged_views(buffer: torch.Tensor, plan: Plan, start: int, stop: int, *, offset: int = 0,
                 shaped: bool = False) -> Dict[str, torch.Tensor]:
    """Views of one slice's states in ``buffer`` from byte ``offset``, each at an aligned offset:
    flat, or shaped as the states are (``shaped``, and a slot staged whole)."""
    views = {}
    for key, shape, dtype in plan.layout:
        numel = torch.Size(shape).numel() if plan.whole else stop - start
        view = buffer[offset:offset + numel * dtype.itemsize].view(dtype)
        views[key] = view.view(shape) if plan.whole or shaped else view
        offset += staged_bytes(numel, dtype)
    return views
