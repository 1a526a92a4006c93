"""OffloadOptimizer: optimizer CPU offload with plain-optimizer math, on any device.

Each trainable parameter gets a *slot*: the parameter, the tensor its base optimizer updates, and
one base-optimizer instance of its own. Large parameters (at least ``minimal_size`` elements) are
*offloaded*: the base optimizer updates a host copy, so its state lives in host memory, and the
result is copied back. Small ones step where they are, since a transfer costs more than it saves.

Keeping one base optimizer per parameter is what lets the engine grow without a rewrite: a slot can
be stepped alone (during backward, as soon as its gradient lands, or from a worker thread), its host
copy can be kept in another dtype (fp32 master weights for bf16 device weights, through the same
``to_device`` copy, which casts), and a different placement strategy only changes how a slot is built.
"""

import functools
import threading
import time
import warnings
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch.optim import Optimizer

from torchtune_offload.optim.capabilities import OFFLOAD_STEPS_AFTER_BACKWARD, OptimizerCapabilities
import torchtune_offload.optim.fused_step as fused_step
from torchtune_offload.optim.grad_norm import (
    clip_,
    clip_coefficient,
    combine_norms,
    tensor_norm,
)
from torchtune_offload.optim.host_allocator import release_freed_host_memory
from torchtune_offload.optim.host_arena import (
    ALLOCATOR,
    NONE,
    PageLockError,
    buffer_bytes,
    host_buffers,
    pinned_allocation_bytes,
    pinning_of,
)
from torchtune_offload.optim.host_memory import (
    HostMemoryPlan,
    host_buffer_dtypes,
    offloaded_buffers_plan,
    offloads,
)
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.optim.optimizer_class import OptimizerClassSpec, resolve_optimizer_class, split_options
from torchtune_offload.optim.overlap import HostWorkers, Window, changed_hyperparameters, hyperparameters
from torchtune_offload.optim.staging import NUM_CHUNKS, StagingRing
from torchtune_offload.optim.transfer import TransferEngine

STATE_DICT_FORMAT = "torchtune_offload.OffloadOptimizer/1"


class _Slot:
    """One trainable parameter and what the optimizer keeps for it."""

    __slots__ = (
        "index", "key", "param", "group_index", "offloaded", "step_param", "host_grad",
        "grad_event", "has_host_grad", "optimizer", "out",
        "staged_token", "norm", "landed", "done", "param_event",
    )

    def __init__(self, *, index: int, key: str, param: torch.Tensor, group_index: int) -> None:
        self.index = index
        self.key = key
        self.param = param
        self.group_index = group_index
        self.offloaded = False
        # What the base optimizer updates: the host copy when offloaded, else the parameter.
        self.step_param = param
        # Offloaded only: the host gradient the step reads.
        self.host_grad: Optional[torch.Tensor] = None
        self.grad_event = None
        # offload_gradients: host_grad holds at least one micro-batch since zero_grad().
        self.has_host_grad = False
        self.optimizer: Optional[Optimizer] = None
        # Master weights in another dtype: the buffer holding the step's result in the parameter's
        # dtype, copied to the parameter (offloaded: a host buffer, the gradient buffer when the
        # dtypes allow; on the device: the parameter itself). None when step_param is the result.
        self.out: Optional[torch.Tensor] = None
        # The 2-norm of the gradient the next step uses, where measured before the gradient left
        # the device or landed (overlap, and serial offload_gradients); None once it is consumed.
        self.norm: Optional[torch.Tensor] = None
        # Overlap only. The staging ring's token for the window's last staged micro-batch; the
        # host workers' futures (gradient landed, step done); the upload's event, which the
        # compute stream waits for before the next forward uses it.
        self.staged_token: Optional[int] = None
        self.landed = None
        self.done = None
        self.param_event = None

    @property
    def has_master(self) -> bool:
        return self.step_param.dtype != self.param.dtype


#: Spellings accepted for the precision options (torch dtypes are accepted too).
_DTYPES = {"fp32": torch.float32, "float32": torch.float32}


def precision_option(value: Any, *, key: str) -> Optional[torch.dtype]:
    """``None`` (the parameter's own dtype) or fp32, from a config string or a torch dtype."""
    if value is None:
        return None
    dtype = value if isinstance(value, torch.dtype) else _DTYPES.get(str(value).lower())
    if dtype not in _DTYPES.values():
        raise ValueError(f"optimizer.{key}={value!r}: use fp32, or leave it unset (null) for the "
                         "parameter's own dtype.")
    return dtype


def _named_groups(params: Any) -> List[Dict[str, Any]]:
    """Normalises ``params`` into groups whose ``params`` are ``(key, tensor)`` pairs.

    Accepts tensors, ``(name, tensor)`` pairs (``model.named_parameters()``), or dicts of either.
    Unnamed parameters are keyed by position, ``"<group>.<index>"``.
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


class OffloadOptimizer(Optimizer):
    """Runs a base optimizer's step on host copies of the parameters, with exact plain-optimizer math.

    A drop-in superset of ``torchao.optim.CPUOffloadOptimizer``'s constructor that also runs on a
    CPU-only machine (host copies are then kept apart from the parameters, an exact emulation of
    the accelerator path), accumulates gradients with ``offload_gradients=True``, clips and scales
    the gradients it steps on, and checkpoints by parameter name.

    Example::

        opt = OffloadOptimizer(model.named_parameters(), "torch.optim.AdamW", lr=1e-4,
                               offload_gradients=True)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()

    Args:
        params: ``model.named_parameters()`` (recommended: checkpoints are then keyed by name),
            parameters, or parameter groups of either. Frozen parameters are skipped.
        optimizer_class: the base optimizer, a class or a dotted path such as
            ``"torch.optim.AdamW"``, ``"torch.optim.SGD"`` or ``"bitsandbytes.optim.AdamW8bit"``.
        offload_gradients: copy each gradient to the host as soon as backward produces it and free
            the device copy, so gradients take no device memory between micro-batches. Gradient
            accumulation still works: micro-batches are summed in host buffers.
        minimal_size: parameters with fewer elements stay on the device and step there.
        master_dtype: ``None`` (default): the base optimizer steps on a copy in the parameter's
            dtype, plain-optimizer math. ``"fp32"``: it steps on fp32 master weights (fp32 state
            too), on the host for offloaded parameters and on the device for the others, and the
            parameter becomes the master rounded to its dtype after each step; pure-bf16 training
            loses small updates to rounding, this does not. The masters are checkpointed. When the
            gradient buffer has the parameter's dtype, the rounded weights are written over the
            consumed gradient (no extra host buffer), so with ``offload_gradients`` a step leaves
            no host gradient behind: the next backward starts a fresh sum, as after ``zero_grad()``.
        grad_sum_dtype: the dtype of host gradient buffers, in which ``offload_gradients`` sums
            micro-batches. ``None`` (default): the parameter's dtype, as plain training sums;
            ``"fp32"``: fp32 sums.
        fused_master_step: with fp32 masters, bf16 parameters and an Adam/AdamW base, step each
            offloaded master in one pass over all host cores that also writes the rounded copy (a C
            loop built at first use, ``optim/fused_step.py``); False, or no C compiler, takes the
            unfused path (widen the gradient, the base step, round).
        overlap: run host steps on worker threads beside GPU work, with the same results. Takes
            effect for windows announced with :meth:`expect_final_backward`; a caller that
            announces nothing gets the serial step-after-backward behaviour. With
            :meth:`register_forward_waits` ``step()`` returns at once and the next forward waits
            module by module; without it ``step()`` waits for the host work before returning.
        **kwargs: passed to the base optimizer, e.g. ``lr``, ``weight_decay``, ``betas``.

    Raises:
        ValueError: on an unresolvable ``optimizer_class``, a negative ``minimal_size``, no
            trainable parameters, or parameters on more than one device.
    """

    capabilities = OptimizerCapabilities(
        offloads=True,
        holds_gradients=True,
        named_parameters=True,
        runs_under_fsdp2=False,
        steps_in_backward=False,
        precision_policy=True,
        step_timings=True,
        overlaps_host_step=True,
        reasons={
            "runs_under_fsdp2": "its state lives in per-parameter base optimizers over host copies of "
            "each rank's shards, which torch's distributed state-dict API (used to gather a full "
            "checkpoint and to resume) cannot see, so checkpoints would not resume",
            "steps_in_backward": OFFLOAD_STEPS_AFTER_BACKWARD,
        },
    )

    def __init__(
        self,
        params: Any,
        optimizer_class: OptimizerClassSpec = "torch.optim.AdamW",
        *,
        offload_gradients: bool = False,
        minimal_size: int = 4096,
        master_dtype: Optional[Union[str, torch.dtype]] = None,
        grad_sum_dtype: Optional[Union[str, torch.dtype]] = None,
        fused_master_step: bool = True,
        overlap: bool = False,
        **kwargs: Any,
    ) -> None:
        base_class = resolve_optimizer_class(optimizer_class)
        self.master_dtype = precision_option(master_dtype, key="master_dtype")
        self.grad_sum_dtype = precision_option(grad_sum_dtype, key="grad_sum_dtype")
        if not isinstance(fused_master_step, bool):
            raise ValueError(f"optimizer.fused_master_step={fused_master_step!r} must be True or False.")
        self.fused_master_step = fused_master_step
        if not isinstance(overlap, bool):
            raise ValueError(f"optimizer.overlap={overlap!r} must be True or False.")
        self.overlap = overlap
        if not isinstance(offload_gradients, bool):
            raise ValueError(
                f"optimizer.offload_gradients={offload_gradients!r} must be True or False."
            )
        if isinstance(minimal_size, bool) or not isinstance(minimal_size, int) or minimal_size < 0:
            raise ValueError(
                f"optimizer.minimal_size={minimal_size!r} must be a non-negative integer "
                "(parameters with fewer elements step on the device; 4096 is the default)."
            )
        groups = _named_groups(params)
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

        self.base_class = base_class
        self.offload_gradients = offload_gradients
        self.minimal_size = minimal_size
        self.device = trainable[0].device
        # Gradients freed between our long-lived host buffers would otherwise stay resident.
        release_freed_host_memory()
        self._transfer = TransferEngine(self.device)
        host_kwargs = dict(kwargs)
        if (
            self._transfer.is_accelerator
            and base_class in (torch.optim.AdamW, torch.optim.Adam)
            and "fused" not in kwargs
        ):
            # The fused CPU kernel is several times faster than the per-tensor loop; on a CPU-only
            # machine the default is kept so the emulation matches plain AdamW bit for bit.
            host_kwargs["fused"] = True

        self._pinning = pinning_of(self.device)
        buffers = self._allocate_host_buffers(groups)
        self._slots: List[_Slot] = []
        self._hooks = []
        outer_groups = []
        seen = set()
        for group in groups:
            options = {k: v for k, v in group.items() if k != "params"}
            members = []
            for key, param in group["params"]:
                if not param.requires_grad:
                    continue
                if key in seen:
                    raise ValueError(f"params: parameter {key!r} is given twice.")
                seen.add(key)
                slot = _Slot(index=len(self._slots) + len(members), key=key, param=param,
                             group_index=len(outer_groups))
                self._place(slot, buffers.get(id(param)), options={**kwargs, **options},
                            host_options={**host_kwargs, **options})
                members.append(slot)
            if not members:
                continue
            hyper = {k: v for k, v in members[0].optimizer.param_groups[0].items() if k != "params"}
            hyper.pop("fused", None)  # a host-side detail; schedulers and logs need not see it
            outer_groups.append({**hyper, "params": [s.param for s in members]})
            self._slots.extend(members)
        self._slot_of = {s.param: s for s in self._slots}
        self._staging = StagingRing(
            self._transfer,
            largest_bytes=max((s.param.numel() * s.param.element_size() for s in self._slots if s.offloaded), default=16),
        )
        if offload_gradients or overlap:
            self._hooks.extend(s.param.register_post_accumulate_grad_hook(self._on_grad) for s in self._slots)
        # Overlap: the announced window, the host worker threads (started on first use), and
        # whether the next forward waits per module (register_forward_waits) or step() waits.
        self._window: Optional[Window] = None
        self._workers: Optional[HostWorkers] = None
        self._forward_waits = False
        # Since the last step(): seconds the training thread waited for host work or copies, and
        # seconds of host steps (summed by the step thread too, hence the lock).
        self._wait_s = 0.0
        self._host_step_s = 0.0
        self._stats_lock = threading.Lock()
        self._timings: Dict[str, float] = {}
        defaults = {k: v for k, v in self._slots[0].optimizer.defaults.items() if k != "fused"}
        # Inheriting Optimizer lets torch's LR schedulers and torchtune's get_lr accept us; the
        # hyper-parameters they edit in self.param_groups reach the base optimizers at each step.
        super().__init__(outer_groups, defaults)

    @classmethod
    def plan_host_memory(
        cls,
        params: Any,
        optimizer_class: OptimizerClassSpec = "torch.optim.AdamW",
        *,
        device: Union[str, torch.device],
        gradient_accumulation_steps: int = 1,
        **options: Any,
    ) -> HostMemoryPlan:
        """The host memory this optimizer would hold for ``params``, allocating nothing.

        Takes the constructor's arguments (``params`` may be meta tensors) plus where training runs.

        Args:
            params: as for the constructor.
            optimizer_class: as for the constructor.
            device: the training device; on an accelerator host buffers are pinned (see
                ``optim/host_arena.py`` for what that takes on each kind of device).
            gradient_accumulation_steps: with ``offload_gradients``, more than one adds the staging ring.
            **options: the constructor's keyword options (``offload_gradients``, ``minimal_size``,
                ``master_dtype``, ``grad_sum_dtype`` change the plan; the others allocate nothing on
                the host) and the base optimizer's.
        """
        own, kwargs = split_options(cls.__init__, options)
        minimal_size = own["minimal_size"]
        base = resolve_optimizer_class(optimizer_class)
        trainable = [p for g in _named_groups(params) for _, p in g["params"] if p.requires_grad]
        pinning = pinning_of(device)
        plan = offloaded_buffers_plan(
            trainable, optimizer_class=base, options=kwargs, minimal_size=minimal_size, pinning=pinning,
            master_dtype=precision_option(own["master_dtype"], key="master_dtype"),
            grad_dtype=precision_option(own["grad_sum_dtype"], key="grad_sum_dtype"),
        )
        offloaded = [p.numel() * p.element_size() for p in trainable if offloads(p, minimal_size)]
        if own["offload_gradients"] and gradient_accumulation_steps > 1 and offloaded:
            chunk = StagingRing.chunk_size(largest_bytes=max(offloaded))
            pinned = pinning != NONE  # the ring's chunks come from torch's allocator
            plan.add("staging ring" + (" (pinned)" if pinned else ""),
                     NUM_CHUNKS * pinned_allocation_bytes(chunk, pinned=pinned))
        return plan

    # ----------------------------------------------------------------------------- construction

    def _allocate_host_buffers(self, groups: List[Dict[str, Any]]) -> Dict[int, Dict[str, torch.Tensor]]:
        """All offloaded parameters' host buffers at once, by ``id(param)`` and purpose: one block
        per purpose, page-locked at its exact size where the device allows (``optim/host_arena.py``).

        Raises:
            ValueError: if one tensor is given under two names.
        """
        owners: Dict[int, Tuple[str, torch.Size, Dict[str, torch.dtype]]] = {}
        for group in groups:
            for key, param in group["params"]:
                if not param.requires_grad or not offloads(param, self.minimal_size):
                    continue
                if id(param) in owners and owners[id(param)][0] != key:
                    raise ValueError(f"params: one tensor is given as {owners[id(param)][0]!r} and as {key!r}; "
                                     "give each parameter once.")
                owners[id(param)] = (key, param.shape, host_buffer_dtypes(
                    param, master_dtype=self.master_dtype, grad_dtype=self.grad_sum_dtype))
        try:
            return self._carve(owners)
        except PageLockError as err:
            warnings.warn(f"host memory could not be page-locked in place ({err}); pinning each buffer with "
                          "torch's allocator instead, which rounds it up to a power of two", stacklevel=3)
            self._pinning = ALLOCATOR
            return self._carve(owners)

    def _carve(self, owners: Dict[int, Tuple[str, torch.Size, Dict[str, torch.dtype]]]) -> Dict[int, Dict[str, torch.Tensor]]:
        buffers: Dict[int, Dict[str, torch.Tensor]] = {owner: {} for owner in owners}
        purposes = dict.fromkeys(purpose for _, _, dtypes in owners.values() for purpose in dtypes)
        for purpose in purposes:
            members = [(owner, shape, dtypes[purpose]) for owner, (_, shape, dtypes) in owners.items()
                       if purpose in dtypes]
            made = host_buffers([(shape, dtype) for _, shape, dtype in members], pinning=self._pinning)
            for (owner, _, _), tensor in zip(members, made):
                buffers[owner][purpose] = tensor
        return buffers

    def _place(self, slot: _Slot, buffers: Optional[Dict[str, torch.Tensor]], *, options: Dict[str, Any],
               host_options: Dict[str, Any]) -> None:
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
            slot.optimizer = self.base_class([slot.step_param], **host_options)
        elif master != param.dtype:
            slot.step_param = param.detach().to(master)
            slot.out = param
            slot.optimizer = self.base_class([slot.step_param], **options)
        else:
            slot.optimizer = self.base_class([param], **options)

    # ------------------------------------------------------------------------------- gradients

    @torch.no_grad()
    def _on_grad(self, param: torch.Tensor) -> None:
        """Backward hook: a parameter's gradient for this backward is complete.

        With ``offload_gradients`` it moves into the host sum and the device copy is freed. In an
        announced final backward (overlap) the window's gradient is also measured and handed to
        the host workers.
        """
        slot = self._slot_of[param]
        grad = param.grad
        if grad is None:
            return
        # The previous window's host work on this slot; finished by now unless no forward ran.
        self._wait_done(slot)
        window = self._window
        if window is not None:
            if slot.index in window.seen:
                raise RuntimeError(
                    f"{slot.key}: a second backward after expect_final_backward(); call it before "
                    "the last backward of the window only, then step()."
                )
            window.seen.add(slot.index)
            window.order.append(slot.index)
        if window is not None or (slot.offloaded and self.offload_gradients):
            # Where the window's whole gradient is on the device, measure it there before it leaves;
            # serial offload_gradients too, so that serial and overlapped clip alike to the bit (a
            # device and the host reduce in different orders).
            summed_on_host = slot.offloaded and self.offload_gradients and slot.has_host_grad
            slot.norm = None if summed_on_host else tensor_norm(grad)
        if slot.offloaded and self.offload_gradients:
            slot.staged_token = None
            if not slot.has_host_grad:
                slot.grad_event = self._transfer.to_host(slot.host_grad, grad, release_source=True)
                slot.has_host_grad = True
            else:
                # A later micro-batch: through the bounded staging ring into the sum.
                slot.staged_token = self._staging.add_into(slot.host_grad, grad)
            param.grad = None
        elif window is not None and slot.offloaded:
            # The device copy stays (offload_gradients=False); the host gets the window's sum now.
            slot.staged_token = None
            slot.grad_event = self._transfer.to_host(slot.host_grad, grad, release_source=True)
        if window is not None and slot.offloaded:
            self._hand_over(slot, window)

    def _hand_over(self, slot: _Slot, window: Window) -> None:
        """Queues a window gradient's landing, and without clipping its step too."""
        if self._workers is None:
            self._workers = HostWorkers()
        slot.landed = self._workers.land(self._land, slot)
        if not window.clipping:
            slot.done = self._workers.step(self._host_step, slot, None)

    @torch.no_grad()  # grad mode is per thread: the workers start in the default mode
    def _land(self, slot: _Slot) -> None:
        """Landing thread: the window's gradient is complete in ``slot.host_grad`` when this returns."""
        self._transfer.wait(slot.grad_event)
        if slot.staged_token is not None:
            self._staging.drain_until(slot.staged_token)
        if slot.norm is None:
            slot.norm = tensor_norm(slot.host_grad)

    @torch.no_grad()
    def _host_step(self, slot: _Slot, coef: Optional[torch.Tensor]) -> None:
        """Step thread: steps one landed slot on the host and sends its new weights up."""
        slot.landed.result()
        if coef is not None:
            slot.host_grad.mul_(coef)
        start = time.perf_counter()
        self._step_slot(slot, slot.host_grad)
        with self._stats_lock:
            self._host_step_s += time.perf_counter() - start
        slot.param_event = self._transfer.to_device(slot.param, slot.out if slot.has_master else slot.step_param)
        # The window's sum is consumed: the next backward starts a fresh one.
        slot.has_host_grad = False

    def _wait_done(self, slot: _Slot) -> None:
        """Blocks until the slot's queued step is done, and orders the compute stream after its upload."""
        if slot.done is None:
            return
        start = time.perf_counter()
        try:
            slot.done.result()
        finally:
            self._wait_s += time.perf_counter() - start
        # The window's gradient is consumed, and with it its norm.
        slot.done = slot.landed = slot.norm = None
        self._transfer.compute_waits_for(slot.param_event)
        slot.param_event = None

    def _wait_landed(self, slot: _Slot) -> None:
        if slot.landed is not None:
            start = time.perf_counter()
            try:
                slot.landed.result()
            finally:
                self._wait_s += time.perf_counter() - start

    def synchronize(self) -> None:
        """Waits for every queued host step and upload; errors raised in a worker are raised here.

        Needed before reading the model's weights outside a forward that
        :meth:`register_forward_waits` covers (``state_dict`` and this optimizer's checkpoint
        methods call it themselves).
        """
        for slot in self._slots:
            self._wait_done(slot)
            self._wait_landed(slot)

    def _finish_host_grad(self, slot: _Slot) -> None:
        """Waits for the slot's gradient copies and folds its staged micro-batches into the sum."""
        start = time.perf_counter()
        self._transfer.wait(slot.grad_event)
        slot.grad_event = None
        # The ring adds in the order chunks were issued, whichever slots they belong to; with
        # nothing staged this is a no-op.
        self._staging.drain()
        self._wait_s += time.perf_counter() - start

    def _grads_to_step(self) -> List[Tuple[_Slot, torch.Tensor]]:
        """The gradients the next step() will use, with their slots, wherever they are, ready to
        read or modify."""
        self.synchronize()
        grads = []
        for slot in self._slots:
            if slot.offloaded and self.offload_gradients:
                if slot.has_host_grad:
                    self._finish_host_grad(slot)
                    grads.append((slot, slot.host_grad))
            elif slot.param.grad is not None:
                grads.append((slot, slot.param.grad))
        return grads

    def _norms(self, grads: List[Tuple[_Slot, torch.Tensor]], norm_type: Union[float, str]) -> List[torch.Tensor]:
        """Each gradient's ``norm_type`` norm. A 2-norm measured on the device before the gradient
        left it (serial ``offload_gradients``, one micro-batch) is reused, as an overlapped window
        reuses it; a slot holds a norm only while it describes the gradient the next step uses."""
        reuse = float(norm_type) == 2.0
        return [slot.norm if reuse and slot.norm is not None else tensor_norm(grad, norm_type=norm_type)
                for slot, grad in grads]

    def _forget_norms(self) -> None:
        """Drops measured norms once the gradients they describe have been changed."""
        for slot in self._slots:
            slot.norm = None

    # -------------------------------------------------------------------------------- overlap

    def expect_final_backward(self, *, clipping: bool) -> None:
        """Announces that the next ``backward()`` ends the accumulation window (overlap).

        Call it right before the window's last backward, then ``step()`` after it. Host steps
        then start as gradients land (``clipping=False``), or as soon as ``step()`` is called
        after ``clip_grad_norm_``/``grad_norm`` (``clipping=True``). The hyper-parameters are
        read here; with ``clipping=False`` ``step()`` refuses a window whose hyper-parameters
        changed since. A no-op unless the optimizer was built with ``overlap=True``.

        Args:
            clipping: the gradients will be clipped (or their norm used) before ``step()``.

        Raises:
            RuntimeError: if the previous announced window was not stepped.
        """
        if not self.overlap:
            return
        if self._window is not None:
            raise RuntimeError("expect_final_backward() twice without step() in between.")
        # The previous window's steps: done by now, as the forward before this backward waited.
        self.synchronize()
        self._window = Window(clipping=bool(clipping), hyper=hyperparameters(self.param_groups))
        if not clipping:
            self._sync_hyperparameters()

    def register_forward_waits(self, model: torch.nn.Module) -> None:
        """Lets ``step()`` return at once (overlap): each module of ``model`` waits, right before
        its forward, for its own parameters' host steps and uploads, and ``model.state_dict()``
        waits for all of them.

        A parameter read outside the forward of the module that owns it (before that module
        runs) needs :meth:`synchronize` first.

        Args:
            model: the module whose parameters this optimizer steps.
        """
        owned: Dict[torch.nn.Module, List[_Slot]] = {}
        for module in model.modules():
            slots = [self._slot_of[p] for p in module.parameters(recurse=False)
                     if p in self._slot_of and self._slot_of[p].offloaded]
            if slots:
                owned[module] = slots
        for module, slots in owned.items():
            self._hooks.append(module.register_forward_pre_hook(functools.partial(self._forward_wait, slots)))
        self._hooks.append(model.register_state_dict_pre_hook(lambda *_args, **_kwargs: self.synchronize()))
        self._forward_waits = True

    # A compiled module (compile=True) runs this eagerly instead of tracing waits on threads.
    @torch.compiler.disable
    def _forward_wait(self, slots: List[_Slot], _module: torch.nn.Module, _args: Any) -> None:
        for slot in slots:
            self._wait_done(slot)

    def _land_stragglers(self, window: Window) -> None:
        """Hands over the gradients of parameters the final backward did not reach (used only in
        earlier micro-batches), so that the window's record is complete."""
        for slot in self._slots:
            if slot.index in window.seen:
                continue
            if slot.offloaded and self.offload_gradients:
                if not slot.has_host_grad:
                    continue
                # slot.norm: measured on the device by the serial hook if one micro-batch made the
                # sum, else None (measured on the host when landed), as in a serial window.
                slot.staged_token = self._staging.issued
            elif slot.param.grad is None:
                continue
            else:
                slot.norm = tensor_norm(slot.param.grad)
                if slot.offloaded:
                    slot.staged_token = None
                    slot.grad_event = self._transfer.to_host(slot.host_grad, slot.param.grad, release_source=True)
            window.seen.add(slot.index)
            window.stragglers.append(slot.index)
            if slot.offloaded:
                self._hand_over(slot, window)

    def _window_norms(self, window: Window) -> List[torch.Tensor]:
        """Each window gradient's norm, in slot order, once landed."""
        self._land_stragglers(window)
        norms = []
        for slot in self._slots:
            if slot.index in window.seen:
                self._wait_landed(slot)
                norms.append(slot.norm)
        return norms

    # ----------------------------------------------------------------------------- norms, clip

    @torch.no_grad()
    def grad_norm(self, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
        """The total norm of the gradients the next step() will use, on the model's device."""
        if self._window is not None:
            if float(norm_type) != 2.0:
                raise ValueError(f"norm_type={norm_type}: an overlapped window measures the 2-norm only.")
            return combine_norms(self._window_norms(self._window), device=self.device)
        return combine_norms(self._norms(self._grads_to_step(), norm_type), norm_type=norm_type, device=self.device)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: Union[float, str] = 2.0,
        *,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clips the gradients the next step() will use, like ``torch.nn.utils.clip_grad_norm_``.

        Args:
            max_norm: the largest total norm allowed.
            norm_type: a p-norm order, or ``inf``.
            error_if_nonfinite: raise if the total norm is nan or inf.

        Returns:
            The total norm before clipping, on the model's device: the value
            ``torch.nn.utils.clip_grad_norm_`` returns for the same model trained without offload.

        Raises:
            RuntimeError: in a window announced with ``clipping=False``, whose steps have started.
        """
        window = self._window
        if window is not None:
            if not window.clipping:
                raise RuntimeError(
                    "clip_grad_norm_() in a window announced with expect_final_backward(clipping=False): "
                    "its host steps have already started. Announce clipping=True to clip."
                )
            if float(norm_type) != 2.0:
                raise ValueError(f"norm_type={norm_type}: an overlapped window clips by the 2-norm only.")
            norm = combine_norms(self._window_norms(window), device=self.device,
                                 error_if_nonfinite=error_if_nonfinite)
            window.coef = clip_coefficient(max_norm=max_norm, norm=norm)
            # Gradients on the device are scaled now, host ones by the step thread before stepping.
            clip_([s.param.grad for s in self._slots if not s.offloaded and s.param.grad is not None],
                  max_norm=max_norm, norm=norm)
            return norm
        grads = self._grads_to_step()
        norm = combine_norms(self._norms(grads, norm_type), norm_type=norm_type, device=self.device,
                             error_if_nonfinite=error_if_nonfinite)
        clip_([g for _, g in grads], max_norm=max_norm, norm=norm)
        self._forget_norms()
        return norm

    @torch.no_grad()
    def scale_grads_(self, factor: Union[float, torch.Tensor]) -> None:
        """Multiplies the gradients the next step() will use by ``factor``.

        For recipes that normalise after backward (torchtune scales by ``1 / num_tokens``): with
        ``offload_gradients`` the device gradients are already gone, so scaling them does nothing.

        Raises:
            RuntimeError: in an overlapped window, whose gradients are already on their way to
                the host steps; scale the loss before backward instead.
        """
        if self._window is not None:
            raise RuntimeError(
                "scale_grads_() after expect_final_backward(): the window's gradients are already "
                "with the host steps. Scale the loss before backward instead."
            )
        for _, g in self._grads_to_step():
            g.mul_(factor.to(g.device) if isinstance(factor, torch.Tensor) else factor)
        self._forget_norms()

    # ------------------------------------------------------------------------------------ step

    def _sync_hyperparameters(self) -> None:
        """Copies what schedulers changed in self.param_groups into each base optimizer."""
        for slot in self._slots:
            outer = self.param_groups[slot.group_index]
            inner = slot.optimizer.param_groups[0]
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    @torch.no_grad()
    def step(self, closure=None):
        """Steps every parameter that has a gradient; offloaded ones on the host.

        In an announced window (overlap) the host steps run on worker threads and this returns
        without waiting for them (see :meth:`expect_final_backward`).

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Raises:
            RuntimeError: in a window announced with ``clipping=False`` whose hyper-parameters
                changed after the announcement (its steps used the announced ones).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        start = time.perf_counter()
        if self._window is not None:
            self._step_window(self._window)
        else:
            self._step_serial()
        copies = self._transfer.copy_seconds()
        with self._stats_lock:
            host_step_s, self._host_step_s = self._host_step_s, 0.0
        wait_s, self._wait_s = self._wait_s, 0.0
        self._timings = {
            "offload_wait_s": wait_s,
            "host_step_s": host_step_s,
            "grad_copy_s": copies["grad"],
            "param_copy_s": copies["param"],
            "offload_step_s": time.perf_counter() - start,
        }
        if host_step_s > 0:
            self._timings["host_step_hidden"] = min(1.0, max(0.0, 1.0 - wait_s / host_step_s))
        return loss

    def _step_on_device(self) -> None:
        """Steps the parameters that stay on the device (on an accelerator, beside the host work)."""
        for slot in self._slots:
            if slot.offloaded:
                continue
            slot.norm = None  # an announced window's, of the gradient this step consumes
            if slot.param.grad is not None:
                if slot.has_master:
                    self._step_slot(slot, slot.param.grad)
                else:
                    slot.optimizer.step()

    def _step_serial(self) -> None:
        self.synchronize()
        self._sync_hyperparameters()
        ready = []
        for slot in self._slots:
            if not slot.offloaded:
                continue
            if self.offload_gradients:
                if slot.has_host_grad:
                    ready.append(slot)
            elif slot.param.grad is not None:
                # Issue every copy first, so later copies stream while earlier slots step.
                slot.grad_event = self._transfer.to_host(slot.host_grad, slot.param.grad)
                ready.append(slot)
        self._step_on_device()
        for slot in ready:
            self._finish_host_grad(slot)
            t0 = time.perf_counter()
            self._step_slot(slot, slot.host_grad)
            # The training thread runs the host step itself here: all of it is waited for.
            seconds = time.perf_counter() - t0
            with self._stats_lock:
                self._host_step_s += seconds
            self._wait_s += seconds
            self._transfer.to_device(slot.param, slot.out if slot.has_master else slot.step_param)
            if slot.out is slot.host_grad:
                # The buffer now holds the new weights, not a gradient: nothing may read, scale,
                # zero or add into it as one until the next backward writes a fresh gradient.
                slot.has_host_grad = False
        # The next forward must see the new parameters.
        self._transfer.compute_waits_for_copies()

    def _step_window(self, window: Window) -> None:
        self._land_stragglers(window)
        if window.clipping:
            self._sync_hyperparameters()
        else:
            changed = changed_hyperparameters(window.hyper, hyperparameters(self.param_groups))
            if changed:
                self._window = None
                self.synchronize()
                raise RuntimeError(
                    "hyper-parameters changed between expect_final_backward(clipping=False) and step(), "
                    "after the host steps had used them: " + "; ".join(changed)
                    + ". Change them after step() (as LR schedulers do), or announce clipping=True."
                )
        self._step_on_device()
        if window.clipping:
            coef = None if window.coef is None else window.coef.to("cpu")
            # The next forward uses the parameters in the reverse of backward's order.
            for index in window.stragglers + window.order[::-1]:
                slot = self._slots[index]
                if slot.offloaded:
                    slot.done = self._workers.step(self._host_step, slot, coef)
        self._window = None
        if not self._forward_waits:
            # Nothing makes the next forward wait per module: wait here, still after backward.
            self.synchronize()

    def step_timings(self) -> Dict[str, float]:
        """Where the time of host work went since the previous ``step()``, in seconds.

        ``offload_wait_s``: the training thread blocked on host work: waiting for copies, running
        host steps itself (serial), or waiting for the host workers (overlap); ``host_step_s``:
        the base optimizer's steps on the host; ``grad_copy_s`` / ``param_copy_s``: gradient
        downloads and weight uploads; ``offload_step_s``: the ``step()`` call itself;
        ``host_step_hidden``: ``1 - offload_wait_s / host_step_s`` clamped to [0, 1], the share of
        the host step the training thread did not wait for. With overlap the host work of a window
        finishes during the next one, so the figures describe the steady state over steps, not
        one window. Empty before the first step.
        """
        return dict(self._timings)

    def _step_slot(self, slot: _Slot, grad: torch.Tensor) -> None:
        """One base-optimizer step of ``slot`` on ``grad``; with a master, the result rounded into ``slot.out``."""
        if (slot.has_master and slot.offloaded and self.fused_master_step
                and fused_step.supports(slot.optimizer, grad, slot.out)
                and fused_step.fused_adamw_step(slot.optimizer, grad, slot.out)):
            return
        # A master is fed the gradient widened to its dtype, as plain fp32 training would be.
        slot.step_param.grad = grad if grad.dtype == slot.step_param.dtype else grad.to(slot.step_param.dtype)
        slot.optimizer.step()
        slot.step_param.grad = None
        if slot.has_master:
            slot.out.copy_(slot.step_param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears gradients on the device and marks host gradient sums empty.

        Host sums a queued step still reads are left to it (it marks them empty when done), so
        this does not wait for host steps.

        Raises:
            RuntimeError: between :meth:`expect_final_backward` and ``step()``.
        """
        if self._window is not None:
            raise RuntimeError("zero_grad() after expect_final_backward() and before step(): the "
                               "window's gradients are with the host steps; call step() first.")
        if not set_to_none:
            # Device gradients may still be being copied down; zeroing must come after.
            self._transfer.compute_waits_for_copies()
        for slot in self._slots:
            if slot.param.grad is not None:
                if set_to_none:
                    slot.param.grad = None
                else:
                    slot.param.grad.zero_()
            if slot.done is not None:
                continue
            if slot.has_host_grad:
                self._finish_host_grad(slot)
                if not set_to_none:
                    slot.host_grad.zero_()
                    slot.norm = None
                slot.has_host_grad = not set_to_none

    # ------------------------------------------------------------------------------ checkpoint

    def state_dict(self) -> Dict[str, Any]:
        """A checkpoint keyed by parameter name (or position), with each slot's placement.

        Tensors are on the host for offloaded parameters and on the device otherwise. Waits for
        queued host steps first.
        """
        self.synchronize()
        groups = []
        for gi, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [s.key for s in self._slots if s.group_index == gi]})
        return {
            "format": STATE_DICT_FORMAT,
            "optimizer_class": f"{self.base_class.__module__}.{self.base_class.__qualname__}",
            "minimal_size": self.minimal_size,
            "param_groups": groups,
            "state": {
                s.key: {
                    "offloaded": s.offloaded,
                    "shape": list(s.param.shape),
                    "dtype": str(s.param.dtype),
                    "optimizer": s.optimizer.state_dict(),
                    # The master weights: the model checkpoint holds only their rounding.
                    **({"master": s.step_param} if s.has_master else {}),
                }
                for s in self._slots
            },
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores a checkpoint from :meth:`state_dict`, after checking that it fits.

        Raises:
            ValueError: if the checkpoint was written by another optimizer, another base
                optimizer, for other parameters (names, shapes, dtypes, groups), or with another
                on-host/on-device split (``minimal_size``). Nothing is loaded in that case.
        """
        self.synchronize()
        problems = self._mismatches(state_dict)
        if problems:
            raise ValueError(
                "optimizer checkpoint does not fit this model and optimizer:\n  - "
                + "\n  - ".join(problems)
                + "\nResume with the model, optimizer_class, parameter groups and minimal_size "
                "that wrote it, or start without resume_from_checkpoint."
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for slot in self._slots:
            saved = state_dict["state"][slot.key]
            slot.optimizer.load_state_dict(saved["optimizer"])
            if slot.has_master:
                with torch.no_grad():
                    slot.step_param.copy_(saved["master"])
                    # The parameter becomes the master's rounding, as after a step.
                    slot.param.copy_(slot.step_param)
        self._sync_hyperparameters()

    def _mismatches(self, sd: Any) -> List[str]:
        if not isinstance(sd, dict) or sd.get("format") != STATE_DICT_FORMAT:
            found = sd.get("format", "no 'format' entry") if isinstance(sd, dict) else type(sd).__name__
            return [
                f"it is not an OffloadOptimizer checkpoint ({found}); it was written by another "
                f"optimizer (expected format {STATE_DICT_FORMAT!r})"
            ]
        problems = []
        mine = f"{self.base_class.__module__}.{self.base_class.__qualname__}"
        if sd["optimizer_class"] != mine:
            problems.append(f"optimizer_class: checkpoint {sd['optimizer_class']}, now {mine}")
        saved_state = sd["state"]
        keys = [s.key for s in self._slots]
        missing = [k for k in keys if k not in saved_state]
        unexpected = [k for k in saved_state if k not in self._slot_of_key()]
        if missing:
            problems.append(f"parameters missing from the checkpoint: {missing[:5]}")
        if unexpected:
            problems.append(f"parameters in the checkpoint but not trainable here: {unexpected[:5]}")
        for slot in self._slots:
            saved = saved_state.get(slot.key)
            if saved is None:
                continue
            if list(saved["shape"]) != list(slot.param.shape) or saved["dtype"] != str(slot.param.dtype):
                problems.append(
                    f"{slot.key}: checkpoint {saved['dtype']}{list(saved['shape'])}, "
                    f"model {slot.param.dtype}{list(slot.param.shape)}"
                )
            elif ("master" in saved) != slot.has_master:
                problems.append(
                    f"{slot.key}: {'has' if 'master' in saved else 'has no'} master weights in the "
                    f"checkpoint, {'needs' if slot.has_master else 'takes none'} now "
                    f"(master_dtype={self.master_dtype})"
                )
            elif saved["offloaded"] != slot.offloaded:
                problems.append(
                    f"{slot.key}: stepped {'on the host' if saved['offloaded'] else 'on the device'} "
                    f"in the checkpoint (minimal_size={sd['minimal_size']}), "
                    f"{'on the host' if slot.offloaded else 'on the device'} now "
                    f"(minimal_size={self.minimal_size})"
                )
        saved_groups = [g["params"] for g in sd["param_groups"]]
        my_groups = [[s.key for s in self._slots if s.group_index == gi] for gi in range(len(self.param_groups))]
        if not problems and saved_groups != my_groups:
            problems.append("parameter groups differ (same parameters, grouped or ordered differently)")
        return problems

    def _slot_of_key(self) -> Dict[str, _Slot]:
        return {s.key: s for s in self._slots}

    # ---------------------------------------------------------------------------------- report

    def memory_report(self) -> OffloadMemoryReport:
        """Counts the bytes this optimizer keeps on the host and spares the device.

        Host buffers are counted as allocated, as :meth:`plan_host_memory` plans: on CUDA each at
        its size rounded up to a page, in one page-locked block; on other accelerators each at its
        size rounded up to a power of two (torch's pinned allocator); the staging ring's chunks,
        made by torch's pinned allocator on any accelerator, likewise.
        """
        pinned = self._pinning != NONE
        saved = host = pinned_total = 0
        for slot in self._slots:
            if not slot.offloaded:
                continue
            state_bytes = sum(
                t.numel() * t.element_size()
                for st in slot.optimizer.state.values()
                for t in st.values()
                if isinstance(t, torch.Tensor)
            )
            grad_bytes = slot.host_grad.numel() * slot.host_grad.element_size()
            held = sum(buffer_bytes(t.numel() * t.element_size(), pinning=self._pinning)
                       for t in self._host_buffers(slot))
            host += state_bytes + held
            pinned_total += held
            saved += state_bytes + (grad_bytes if self.offload_gradients else 0)
        num_offloaded = sum(s.offloaded for s in self._slots)
        # Only buffers made by the transfer engine are pinned; states are plain host memory.
        staging = self._staging.num_allocated * pinned_allocation_bytes(self._staging.chunk_bytes, pinned=pinned)
        return OffloadMemoryReport(
            num_offloaded=num_offloaded,
            num_on_device=len(self._slots) - num_offloaded,
            device_bytes_saved=saved,
            host_bytes=host + staging,
            pinned_bytes=pinned_total + staging if pinned else 0,
        )

    @staticmethod
    def _host_buffers(slot: _Slot) -> List[torch.Tensor]:
        """The host buffers of an offloaded slot (pinned on an accelerator)."""
        extra = [slot.out] if slot.out is not None and slot.out is not slot.host_grad else []
        return [slot.step_param, slot.host_grad, *extra]

    def close(self) -> None:
        """Finishes queued host work, stops the host worker threads and removes every hook
        (backward, forward waits), leaving the model as it was."""
        try:
            self.synchronize()
        finally:
            for handle in self._hooks:
                handle.remove()
            self._hooks.clear()
            self._forward_waits = False
            if self._workers is not None:
                self._workers.shutdown()
                self._workers = None
