"""The parameter table of :class:`~torchtune_offload.optim.OffloadOptimizer`: one *slot* per
trainable parameter, where it steps, its host buffers and its base optimizer.

Large parameters (at least ``minimal_size`` elements) are *offloaded*: their base optimizer
updates a host copy, so its state lives in host memory. Small ones step where they are, since a
transfer costs more than it saves. Keeping one base optimizer per parameter lets a slot be stepped
alone (from a worker thread, as soon as its gradient lands), lets its host copy be kept in another
dtype (fp32 master weights), and makes a different placement only a different way to build a slot.

The table is built once and not changed afterwards: the mutable life of a slot's gradient belongs
to ``host_grads.HostGradients``, that of its queued host work to ``overlap.OverlapScheduler``.
"""

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.optim import Optimizer

from torchtune_offload.optim.base_options import check_group_options
from torchtune_offload.optim.host_arena import ALLOCATOR, PageLockError, host_buffers
from torchtune_offload.optim.host_buffers import host_buffer_dtypes, offloads

#: ``(key, shape, dtypes by purpose)`` of each offloaded parameter, by ``id(param)``.
_Owners = Dict[int, Tuple[str, torch.Size, Dict[str, torch.dtype]]]


class Slot:
    """One trainable parameter and what the optimizer keeps for it (fixed once built).

    Attributes:
        index: position in the table (and in backward bookkeeping).
        key: the parameter's name, or ``"<group>.<index>"`` when unnamed.
        param: the model's parameter.
        group_index: its parameter group.
        offloaded: the base optimizer steps a host copy.
        streamed: ``update_on="device"``: the base optimizer steps the parameter on the device,
            with states kept in host memory between steps (``state_streamer.StateStreamer``).
        step_param: what the base optimizer updates: the host copy when offloaded, an fp32 master
            on the device for a device-resident parameter with ``master_dtype``, else ``param``.
        host_grad: offloaded only: the host gradient the step reads.
        optimizer: the slot's own base optimizer.
        out: with master weights, the buffer holding the step's result in the parameter's dtype,
            copied to the parameter (offloaded: a host buffer, the gradient buffer when the dtypes
            allow; on the device: the parameter itself); None when ``step_param`` is the result.
    """

    __slots__ = ("index", "key", "param", "group_index", "offloaded", "streamed", "step_param", "host_grad",
                 "optimizer", "out")

    def __init__(self, *, index: int, key: str, param: torch.Tensor, group_index: int) -> None:
        self.index = index
        self.key = key
        self.param = param
        self.group_index = group_index
        self.offloaded = False
        self.streamed = False
        self.step_param = param
        self.host_grad: Optional[torch.Tensor] = None
        self.optimizer: Optional[Optimizer] = None
        self.out: Optional[torch.Tensor] = None

    @property
    def has_master(self) -> bool:
        return self.step_param.dtype != self.param.dtype

    @property
    def result(self) -> torch.Tensor:
        """The tensor holding the stepped weights in the parameter's dtype (what goes to the device)."""
        return self.out if self.has_master else self.step_param

    @property
    def host_buffers(self) -> List[torch.Tensor]:
        """The host buffers of an offloaded slot (pinned on an accelerator)."""
        extra = [self.out] if self.out is not None and self.out is not self.host_grad else []
        return [self.step_param, self.host_grad, *extra]


def named_groups(params: Any) -> List[Dict[str, Any]]:
    """Normalises ``params`` into groups whose ``params`` are ``(key, tensor)`` pairs.

    Accepts tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or dicts of either.
    Unnamed parameters are keyed by position, ``"<group>.<index>"``.

    Raises:
        ValueError: on a single tensor, an empty list, or entries of the wrong kind.
    """
    if isinstance(params, torch.Tensor):
        raise ValueError(
            "params: got a single tensor; pass an iterable such as model.parameters() or "
            "model.named_parameters()."
        )
    items = list(params)
    if not items:
        raise ValueError("params: got an empty parameter list; pass model.named_parameters().")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    named = []
    for gi, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ValueError(
                "params: mix of parameter groups and parameters; pass either dicts with a "
                "'params' entry or parameters, not both."
            )
        entries = group["params"]
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        pairs = []
        for i, entry in enumerate(entries):
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                pairs.append(entry)
            elif isinstance(entry, torch.Tensor):
                pairs.append((f"{gi}.{i}", entry))
            else:
                raise ValueError(
                    f"params: group {gi} entry {i} is a {type(entry).__name__}; expected a "
                    "tensor or a (name, tensor) pair."
                )
        named.append({**group, "params": pairs})
    return named


def training_device(groups: List[Dict[str, Any]]) -> torch.device:
    """The one device of the trainable parameters of ``groups`` (from :func:`named_groups`).

    Raises:
        ValueError: if no parameter requires grad, or they are on several devices.
    """
    trainable = [p for g in groups for _, p in g["params"] if p.requires_grad]
    if not trainable:
        raise ValueError(
            "params: no parameter requires grad, so there is nothing to optimize. "
            "Unfreeze parameters or pass the trainable ones."
        )
    devices = {p.device for p in trainable}
    if len(devices) > 1:
        raise ValueError(
            f"params: trainable parameters are on several devices {sorted(map(str, devices))}; "
            "OffloadOptimizer serves one device. Move the model to one device first."
        )
    return trainable[0].device


class ParameterTable:
    """Builds every slot: placement, host buffers (page-locked where the device allows), fp32
    masters and base optimizers; the only writer of the slots.

    Args:
        groups: from :func:`named_groups`.
        base_class: the base optimizer class.
        options: the base optimizer's options.
        accelerator: training runs on an accelerator (offloaded Adam/AdamW then takes torch's
            fused CPU kernel, unless ``options`` says otherwise).
        minimal_size: parameters with fewer elements stay on the device.
        master_dtype: the dtype of the stepped copy, ``None`` for the parameter's.
        grad_sum_dtype: the dtype of host gradient buffers, ``None`` for the parameter's.
        pinning: how host buffers are page-locked (``optim/host_arena.py``); may fall back to
            torch's allocator, see :attr:`pinning`.
        update_on: ``"device"``: no parameter is offloaded; those of at least ``minimal_size``
            elements are *streamed* instead (their states are the streamer's to keep).

    Raises:
        ValueError: if a parameter is given twice, one tensor under two names, or a group's option
            is one the base optimizer refuses (all before any host buffer is made).
    """

    def __init__(self, groups: List[Dict[str, Any]], *, base_class: type, options: Dict[str, Any],
                 accelerator: bool, minimal_size: int, master_dtype: Optional[torch.dtype],
                 grad_sum_dtype: Optional[torch.dtype], pinning: str, update_on: str = "host") -> None:
        self.minimal_size = minimal_size
        self.update_on = update_on
        self.master_dtype = master_dtype
        self.grad_sum_dtype = grad_sum_dtype
        self.pinning = pinning
        host_options = dict(options)
        if accelerator and base_class in (torch.optim.AdamW, torch.optim.Adam) and "fused" not in options:
            # The fused CPU kernel is several times faster than the per-tensor loop; on a CPU-only
            # machine the default is kept so the emulation matches plain AdamW bit for bit.
            host_options["fused"] = True
        # The host step's options only where there is one (update_on="device" steps on the device).
        check_groups(groups, base_class=base_class, options=options,
                     host_options=host_options if update_on == "host" else None)
        buffers = self._allocate_host_buffers(groups) if update_on == "host" else {}
        self.slots: List[Slot] = []
        #: The parameter groups torch's ``Optimizer`` is built with: each base optimizer's options.
        self.outer_groups: List[Dict[str, Any]] = []
        #: Per outer group, the options its base optimizers were built with (on the device).
        self.group_options: List[Dict[str, Any]] = []
        for group in groups:
            group_options = {k: v for k, v in group.items() if k != "params"}
            members = []
            for key, param in group["params"]:
                if not param.requires_grad:
                    continue
                slot = Slot(index=len(self.slots) + len(members), key=key, param=param,
                            group_index=len(self.outer_groups))
                self._place(slot, buffers.get(id(param)), base_class=base_class,
                            options={**options, **group_options}, host_options={**host_options, **group_options})
                members.append(slot)
            if not members:
                continue
            hyper = {k: v for k, v in members[0].optimizer.param_groups[0].items() if k != "params"}
            hyper.pop("fused", None)  # a host-side detail; schedulers and logs need not see it
            self.outer_groups.append({**hyper, "params": [s.param for s in members]})
            self.group_options.append({**options, **group_options})
            self.slots.extend(members)
        self.slot_of: Dict[torch.Tensor, Slot] = {s.param: s for s in self.slots}
        self.slot_of_key: Dict[str, Slot] = {s.key: s for s in self.slots}

    @property
    def offloaded(self) -> List[Slot]:
        return [s for s in self.slots if s.offloaded]

    @property
    def streamed(self) -> List[Slot]:
        return [s for s in self.slots if s.streamed]

    @property
    def largest_offloaded_bytes(self) -> int:
        return max((s.param.numel() * s.param.element_size() for s in self.offloaded), default=16)

    @property
    def largest_host_grad_bytes(self) -> int:
        """The largest offloaded gradient buffer (a sum may be wider than its parameter)."""
        return max((s.host_grad.numel() * s.host_grad.element_size() for s in self.offloaded), default=16)

    def _allocate_host_buffers(self, groups: List[Dict[str, Any]]) -> Dict[int, Dict[str, torch.Tensor]]:
        """All offloaded parameters' host buffers at once, by ``id(param)`` and purpose: one block
        per purpose, page-locked at its exact size where the device allows (``optim/host_arena.py``)."""
        owners: _Owners = {}
        for group in groups:
            for key, param in group["params"]:
                if not param.requires_grad or not offloads(param, self.minimal_size):
                    continue
                owners[id(param)] = (key, param.shape, host_buffer_dtypes(
                    param, master_dtype=self.master_dtype, grad_dtype=self.grad_sum_dtype))
        try:
            return self._carve(owners)
        except PageLockError as err:
            warnings.warn(f"host memory could not be page-locked in place ({err}); pinning each buffer with "
                          "torch's allocator instead, which rounds it up to a power of two", stacklevel=4)
            self.pinning = ALLOCATOR
            return self._carve(owners)

    def _carve(self, owners: _Owners) -> Dict[int, Dict[str, torch.Tensor]]:
        buffers: Dict[int, Dict[str, torch.Tensor]] = {owner: {} for owner in owners}
        purposes = dict.fromkeys(purpose for _, _, dtypes in owners.values() for purpose in dtypes)
        for purpose in purposes:
            members = [(owner, shape, dtypes[purpose]) for owner, (_, shape, dtypes) in owners.items()
                       if purpose in dtypes]
            made = host_buffers([(shape, dtype) for _, shape, dtype in members], pinning=self.pinning)
            for (owner, _, _), tensor in zip(members, made):
                buffers[owner][purpose] = tensor
        return buffers

    def _place(self, slot: Slot, buffers: Optional[Dict[str, torch.Tensor]], *, base_class: type,
               options: Dict[str, Any], host_options: Dict[str, Any]) -> None:
        """Sets up ``slot``'s stepping: on the host in ``buffers`` (by purpose) when it is offloaded."""
        param = slot.param
        master = self.master_dtype or param.dtype
        if buffers is not None:
            slot.offloaded = True
            with torch.no_grad():
                slot.step_param = buffers["parameter copies"].copy_(param.detach())
            slot.host_grad = buffers["gradient buffers"]
            if slot.has_master:
                # The step's result in the parameter's dtype: written over the gradient it has
                # consumed when the dtypes match, so a master costs no extra buffer then.
                slot.out = buffers.get("device-dtype copies", slot.host_grad)
            slot.optimizer = base_class([slot.step_param], **host_options)
        elif self.update_on == "device":
            # The device's own update, with the options as given: plain training's kernel.
            slot.streamed = offloads(param, self.minimal_size)
            slot.optimizer = base_class([param], **options)
        elif master != param.dtype:
            slot.step_param = param.detach().to(master)
            slot.out = param
            slot.optimizer = base_class([slot.step_param], **options)
        else:
            slot.optimizer = base_class([param], **options)


def check_groups(groups: List[Dict[str, Any]], *, base_class: type, options: Dict[str, Any],
                 host_options: Optional[Dict[str, Any]] = None) -> None:
    """What a :class:`ParameterTable` refuses in ``groups`` (named, :func:`named_groups`), before
    anything is allocated: a parameter given twice, and the options of a group with a trainable
    parameter that the base optimizer refuses, with ``options`` and, on the host, ``host_options``.

    Raises:
        ValueError: naming the parameter or the group's option.
    """
    _check_each_given_once(groups)
    trained = [g if any(p.requires_grad for _, p in g["params"]) else None for g in groups]
    extra = {k: v for k, v in (host_options or {}).items() if options.get(k) != v}
    check_group_options(base_class, options, trained, owner="OffloadOptimizer", extra_options=extra)


def _check_each_given_once(groups: List[Dict[str, Any]]) -> None:
    """Every trainable parameter once, under one name: a tensor given twice would be stepped twice
    (torch only warns), and one name twice would share a slot.

    Raises:
        ValueError: naming the parameter given twice, or the two names of one tensor.
    """
    names: Dict[int, str] = {}
    seen = set()
    for group in groups:
        for key, param in group["params"]:
            if not param.requires_grad:
                continue
            if key in seen:
                raise ValueError(f"params: parameter {key!r} is given twice.")
            if id(param) in names:
                raise ValueError(f"params: one tensor is given as {names[id(param)]!r} and as {key!r}; "
                                 "give each parameter once.")
            seen.add(key)
            names[id(param)] = key


