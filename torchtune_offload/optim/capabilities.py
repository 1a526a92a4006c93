"""What an optimizer can do, declared once by the optimizer and asked by everything else.

The recipes' config check and the gradient stepper need to know, for the configured optimizer,
whether it can clip, whether it keeps its own copies of the gradients, whether it runs under FSDP2,
and so on. Rather than every checker keeping its own list of optimizer names, an optimizer class
declares an :class:`OptimizerCapabilities` as its ``capabilities`` attribute, and
:func:`capabilities_of` answers for any class: the declaration where there is one, else the
defaults of :data:`PLAIN_CAPABILITIES` (torch's optimizers), adjusted by one table for the
families of plain optimizers that differ (bitsandbytes).
"""

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple


@dataclass(frozen=True)
class OptimizerCapabilities:
    """What an optimizer class can do, and why not where it cannot.

    Attributes:
        offloads: steps on host copies of the parameters, configured with ``optimizer_class``
            (the base optimizer) and ``minimal_size``, and may offload the gradients too.
        named_parameters: takes ``model.named_parameters()`` pairs (its checkpoint is keyed by name).
        can_clip: the gradients it steps on can be clipped before the step.
        accumulates_offloaded_grads: gradient accumulation works with the gradients offloaded.
        runs_under_fsdp2: can step FSDP2's sharded parameters and checkpoint through torch's
            distributed state-dict API.
        steps_in_backward: can serve as one of ``optimizer_in_bwd``'s per-parameter optimizers.
        device_types: the device types it runs on; ``None`` for any.
        step_timings: reports, through ``step_timings()``, where its last ``step()`` spent its time.
        precision_policy: takes ``master_dtype`` (fp32 master weights and state for bf16
            parameters) and ``grad_sum_dtype`` (the dtype gradients are summed in).
        elementwise_update: its update of each element reads only that element's parameter,
            gradient and state (and per-tensor scalars such as a step count), so a tensor can be
            stepped slice by slice with the same result (``update_on="device"`` streams such
            states in slices; blockwise or factored states are staged whole).
        kernels_on_current_stream: its update's device kernels run on torch's current stream
            (so ``update_on="device"`` with ``overlap`` may run them on a side stream, ordered by
            events); bitsandbytes' optimizer kernels run on CUDA's legacy default stream.
        overlaps_host_step: takes ``overlap`` and can run its host steps beside GPU work, told
            through ``expect_final_backward(clipping=...)`` which backward ends a window, through
            ``register_forward_waits(model)`` that the next forward waits per module, and
            ``synchronize()`` before the weights are read.
        hands_over_per_group: takes the gradients backward makes once per transformer layer or
            bucket of other parameters (``optim/handoff.py``), so that with gradients offloaded
            a layer's gradients stay on the device until its last one is made; an optimizer that
            offloads gradients without it frees each one as it is made.
        scales_gradients_in_step: its ``step(grad_scale=...)`` takes a clipping factor and steps as
            after ``p.grad.mul_(grad_scale)``, to the bit, leaving the gradients unscaled (where its
            pass can, it multiplies as it reads them, sparing a pass of their own).
        steps_tensors_apart: a step over several tensors of one parameter group gives each the update
            a step of it alone gives, to the bit (each tensor's arithmetic and state its own), so the
            engine steps a module's offloaded slots with one call (``optim/step_together.py``).
        reasons: for a capability it lacks (by attribute name), why; named in error messages.
    """

    offloads: bool = False
    named_parameters: bool = False
    can_clip: bool = True
    accumulates_offloaded_grads: bool = True
    runs_under_fsdp2: bool = True
    steps_in_backward: bool = True
    device_types: Optional[Tuple[str, ...]] = None
    precision_policy: bool = False
    step_timings: bool = False
    overlaps_host_step: bool = False
    hands_over_per_group: bool = False
    scales_gradients_in_step: bool = False
    elementwise_update: bool = False
    kernels_on_current_stream: bool = True
    steps_tensors_apart: bool = False
    reasons: Mapping[str, str] = field(default_factory=dict)

    def why_not(self, capability: str) -> str:
        """The declared reason this optimizer lacks ``capability`` (an attribute name)."""
        return self.reasons.get(capability, f"it does not declare {capability}")


#: Why an offloading optimizer cannot be one of ``optimizer_in_bwd``'s per-parameter optimizers.
OFFLOAD_STEPS_AFTER_BACKWARD = "an offloading optimizer cannot step inside backward with exact gradient math"

#: ``OffloadOptimizer``'s: per-parameter base optimizers over host copies, stepped after backward.
ENGINE_CAPABILITIES = OptimizerCapabilities(
    offloads=True,
    named_parameters=True,
    runs_under_fsdp2=False,
    steps_in_backward=False,
    precision_policy=True,
    step_timings=True,
    overlaps_host_step=True,
    hands_over_per_group=True,
    reasons={
        "runs_under_fsdp2": "it does not step FSDP2's DTensors itself; the distributed recipe runs it on each "
        "rank's local shards (distributed/sharded_offload.py) once its other options pass the checks",
        "steps_in_backward": OFFLOAD_STEPS_AFTER_BACKWARD,
    },
)

#: torch's optimizers: they step on the model's ``.grad`` tensors, wherever the model is.
PLAIN_CAPABILITIES = OptimizerCapabilities(reasons={
    "overlaps_host_step": "a plain optimizer steps where the parameters are, after backward; "
    "optimizer._component_=torchtune_offload.OffloadOptimizer overlaps its host step",
    "precision_policy": "a plain optimizer steps on the parameters in their own dtype; "
    "optimizer._component_=torchtune_offload.OffloadOptimizer keeps fp32 masters on the host",
})

#: Plain optimizers whose module starts with a prefix here differ from the defaults so.
_PLAIN_BY_MODULE_PREFIX: Mapping[str, OptimizerCapabilities] = {
    "bitsandbytes.": dataclasses.replace(
        PLAIN_CAPABILITIES,
        runs_under_fsdp2=False,
        kernels_on_current_stream=False,
        reasons={
            **PLAIN_CAPABILITIES.reasons,
            "runs_under_fsdp2": "bitsandbytes' update kernels have no DTensor sharding rules, so "
            "they cannot step FSDP2 shards",
        },
    ),
}


#: torch's optimizers whose update is elementwise (see ``OptimizerCapabilities.elementwise_update``);
#: torch's classes cannot declare it themselves.
_ELEMENTWISE_TORCH = frozenset({"Adam", "AdamW", "SGD", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
                                "Adadelta", "Rprop", "ASGD"})
#: torch's optimizers that step several tensors as each alone (``OptimizerCapabilities.steps_tensors_apart``),
#: in each of their loops (single-tensor, foreach, fused): tests/optim/test_step_together.py checks them.
_APART_TORCH = frozenset({"Adam", "AdamW"})


def capabilities_of(optimizer_class: type) -> OptimizerCapabilities:
    """What ``optimizer_class`` can do: its own declaration, or the table's defaults.

    Args:
        optimizer_class: any optimizer class.
    """
    declared = getattr(optimizer_class, "capabilities", None)
    if isinstance(declared, OptimizerCapabilities):
        return declared
    module = getattr(optimizer_class, "__module__", "") or ""
    for prefix, capabilities in _PLAIN_BY_MODULE_PREFIX.items():
        if module.startswith(prefix):
            return capabilities
    if module.startswith("torch.optim") and optimizer_class.__name__ in _ELEMENTWISE_TORCH:
        return dataclasses.replace(PLAIN_CAPABILITIES, elementwise_update=True,
                                   steps_tensors_apart=optimizer_class.__name__ in _APART_TORCH)
    return PLAIN_CAPABILITIES
