"""CPUOffloadOptimizer: torchao's offload optimizer, configurable from a torchtune YAML.

torchao's class takes the base optimizer as a class, which a YAML cannot hold; this subclass takes
a dotted path too and checks its inputs up front. The step itself is torchao's. For gradient
accumulation with ``offload_gradients``, clipping, or machines without CUDA/XPU, use
:class:`torchtune_offload.OffloadOptimizer`.
"""

import functools
from typing import Any, Dict, List, Tuple, Union

import torch
import torchao.optim

from torchtune_offload.optim.base_options import check_base_options
from torchtune_offload.optim.capabilities import OFFLOAD_STEPS_AFTER_BACKWARD, OptimizerCapabilities
from torchtune_offload.optim.driver_check import check_recipe_drives
from torchtune_offload.optim.grad_norm import checked_norm_type, combine_norms, tensor_norm, total_norm
from torchtune_offload.optim.host_arena import ALLOCATOR, NONE, pinned_allocation_bytes
from torchtune_offload.optim.host_memory import HostMemoryPlan, offloaded_buffers_plan
from torchtune_offload.optim.memory_report import OffloadMemoryReport
from torchtune_offload.optim.offload_options import OffloadOptions, check_accumulation_steps
from torchtune_offload.optim.optimizer_class import DEFAULT_BASE, OptimizerClassSpec, resolve_optimizer_class, split_options


def _strip_names(params: Any) -> Any:
    """torchao expects tensors: drops the names of ``named_parameters()`` pairs."""

    def plain(entries):
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        return [e[1] if isinstance(e, tuple) else e for e in entries]

    items = list(params)
    if items and isinstance(items[0], dict):
        return [{**g, "params": plain(g["params"])} for g in items]
    return plain(items)


class CPUOffloadOptimizer(torchao.optim.CPUOffloadOptimizer):
    """torchao's ``CPUOffloadOptimizer`` with ``optimizer_class`` resolvable from a dotted path.

    Args:
        params: parameters, ``(name, parameter)`` pairs, or parameter groups.
        optimizer_class: the base optimizer, a class or a dotted path such as
            ``"torch.optim.AdamW"``.
        offload_gradients: free device gradients once copied to the host. torchao does not
            support gradient accumulation in this mode.
        minimal_size: parameters with fewer elements stay on the device.
        **kwargs: passed to the base optimizer.

    Raises:
        ValueError: on an unresolvable ``optimizer_class``, or when there is no CUDA/XPU device or
            the parameters are not on it.
    """

    capabilities = OptimizerCapabilities(
        offloads=True,
        can_clip=False,
        accumulates_offloaded_grads=False,
        runs_under_fsdp2=False,
        steps_in_backward=False,
        device_types=("cuda", "xpu"),
        reasons={
            "can_clip": "torchao steps on gradients copied during backward and cannot clip them",
            "precision_policy": "torchao steps on host copies in the parameters' own dtype",
            "accumulates_offloaded_grads": "with offload_gradients=True torchao keeps only the last "
            "micro-batch's gradients",
            "runs_under_fsdp2": "its checkpoint is its own list of per-tensor host states, which "
            "torch's distributed state-dict API cannot gather or scatter, and it cannot clip",
            "steps_in_backward": OFFLOAD_STEPS_AFTER_BACKWARD,
            "device_types": "torchao's optimizer needs CUDA or XPU",
        },
    )

    def __init__(
        self,
        params: Any,
        optimizer_class: OptimizerClassSpec = DEFAULT_BASE,
        *,
        offload_gradients: bool = False,
        minimal_size: int = 4096,
        **kwargs: Any,
    ) -> None:
        base_class = resolve_optimizer_class(optimizer_class)
        # A refused option value is named with its key on any machine, before the device check.
        check_base_options(base_class, kwargs, owner=f"CPUOffloadOptimizer (base {base_class.__name__})")
        self.check_own_options({"offload_gradients": offload_gradients, "minimal_size": minimal_size})
        check_recipe_drives({"offload_gradients": offload_gradients}, owner="CPUOffloadOptimizer")
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is None or accelerator.type not in self.capabilities.device_types:
            raise ValueError(
                "optimizer._component_=torchtune_offload.CPUOffloadOptimizer needs a CUDA or XPU "
                f"device (torchao's implementation), and this machine has "
                f"{'none' if accelerator is None else accelerator.type}. Use "
                "optimizer._component_=torchtune_offload.OffloadOptimizer, which runs anywhere."
            )
        params = _strip_names(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        off_device = {
            str(p.device)
            for g in groups
            for p in g["params"]
            if p.requires_grad and p.device.type != accelerator.type
        }
        if off_device:
            raise ValueError(
                f"torchtune_offload.CPUOffloadOptimizer: parameters are on {sorted(off_device)}, "
                f"not on {accelerator.type}. Set device={accelerator.type} or use "
                "torchtune_offload.OffloadOptimizer."
            )
        self.base_class = base_class
        self.offload_gradients = offload_gradients
        # Each gradient's 2-norm, measured on the device as backward completes it: the recipe logs
        # the norm every step, and measuring it over torchao's host copies was a pass over every
        # gradient on the host, after waiting for all of their copies, before each step (torchtune's
        # recipe measures none without clipping). Registered before torchao's own hooks, which run
        # after these and free the device gradient with offload_gradients.
        self._device_norms: Dict[torch.Tensor, torch.Tensor] = {}
        hooks = [param.register_post_accumulate_grad_hook(self._measure)
                 for group in groups for param in group["params"] if param.requires_grad]
        try:
            super().__init__(
                params,
                base_class,
                offload_gradients=offload_gradients,
                minimal_size=minimal_size,
                **kwargs,
            )
        except Exception:
            # The parameters outlive an optimizer that failed to build. (Hooks torchao's own
            # constructor registered before failing stay: it keeps no handles to remove them by.)
            for hook in hooks:
                hook.remove()
            raise
        if not offload_gradients:
            # torchao copies each device gradient down on its side stream after every micro-batch,
            # and the next micro-batch's backward adds into that same gradient on the compute
            # stream, which nothing made wait for the copy (TORCH_CUDA_SANITIZER caught the race on
            # an H100). Before each addition the compute stream waits for that gradient's copy.
            for param in self.param_d2h_map:
                param.register_hook(functools.partial(self._await_copy, param))

    @staticmethod
    def check_own_options(own: Dict[str, Any]) -> OffloadOptions:
        """This wrapper's own options (``split_options``' first part: each given or at its default),
        checked on any machine (torchao checks neither: the string ``"false"`` would turn gradient
        offload on), typed as the engine's are (its other options at their defaults).

        Raises:
            ValueError: naming ``optimizer.<key>``.
        """
        return OffloadOptions.parse(**own)

    @classmethod
    def plan_host_memory(
        cls,
        params: Any,
        optimizer_class: OptimizerClassSpec = DEFAULT_BASE,
        *,
        device: Union[str, torch.device],
        gradient_accumulation_steps: int = 1,
        **options: Any,
    ) -> HostMemoryPlan:
        """The host memory torchao's optimizer would hold for ``params`` (meta tensors will do).

        torchao pins a host copy and a gradient buffer per parameter of at least ``minimal_size``
        elements, each its own (power-of-two rounded) allocation; the base optimizer's state is plain
        host memory. ``offload_gradients`` and accumulation add nothing.

        Raises:
            ValueError: for an option the constructor would refuse, or a
                ``gradient_accumulation_steps`` that is not an integer >= 1.
        """
        check_accumulation_steps(gradient_accumulation_steps)  # which adds no host memory of its own
        own, kwargs = split_options(cls.__init__, options)
        base_class = resolve_optimizer_class(optimizer_class)
        # What the constructor would refuse is refused here: a plan of a run that cannot start misleads.
        check_base_options(base_class, kwargs, owner=f"CPUOffloadOptimizer (base {base_class.__name__})")
        opts = cls.check_own_options(own)
        params = _strip_names(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        trainable = [p for g in groups for p in g["params"] if p.requires_grad]
        return offloaded_buffers_plan(trainable, optimizer_class=base_class,
                                      options=kwargs, minimal_size=opts.minimal_size,
                                      pinning=NONE if torch.device(device).type == "cpu" else ALLOCATOR)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.d_opt is not None:
            # torch's load_state_dict gives the on-device optimizer new group dicts; torchao's
            # param_groups (what an LR scheduler reads and sets) kept the old ones, so a resumed
            # run lacked initial_lr and its schedule no longer reached the on-device step.
            self.d_param_groups = self.d_opt.param_groups

    def _stepped(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, the gradient the next step uses)``, in one fixed order: the offloaded
        parameters' host copies, then the on-device parameters' own gradients."""
        pairs = [(p_dev, p_host.grad) for p_dev, p_host in self.param_d2h_map.items() if p_dev in self.queue]
        pairs += [(p, p.grad) for group in self.d_param_groups for p in group["params"] if p.grad is not None]
        return pairs

    def _grads_to_step(self) -> List[torch.Tensor]:
        # torchao copies gradients to its host parameters during backward; wait for those copies.
        for event in self.queue.values():
            event.synchronize()
        return [grad for _, grad in self._stepped()]

    def _await_copy(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward hook, before ``grad`` is added into ``param.grad``: the adding stream waits
        for torchao's copy of ``param.grad`` from the micro-batch before (none since a step)."""
        del grad  # unchanged
        event = self.queue.get(param)
        if event is not None and param.grad is not None:
            getattr(torch, self.device).current_stream().wait_event(event)

    @torch.no_grad()
    def _measure(self, param: torch.Tensor) -> None:
        """Backward hook: ``param``'s gradient (summed over the micro-batches so far) is complete."""
        if param.grad is not None:
            self._device_norms[param] = tensor_norm(param.grad)

    @torch.no_grad()
    def grad_norm(self, norm_type: Union[float, str] = 2.0) -> torch.Tensor:
        """The total norm of the gradients the next step() will use, on the device: the 2-norm from
        the norms measured on the device during backward (no pass over the host copies), another
        order from the host copies.

        Raises:
            ValueError: for an order that is not positive (or ``inf``).
        """
        if checked_norm_type(norm_type) != 2.0:
            return total_norm(self._grads_to_step(), norm_type=norm_type, device=self.device)
        # In _stepped()'s order, as the host copies' norms were combined.
        return combine_norms([self._device_norms[p] for p, _ in self._stepped()], device=self.device)

    def memory_report(self) -> OffloadMemoryReport:
        """Counts the bytes torchao keeps on the host (pinned copies, gradients, state)."""

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def held(t: torch.Tensor) -> int:
            # torchao pins with torch's allocator, which hands out a power of two (as planned).
            return pinned_allocation_bytes(nbytes(t), pinned=t.is_pinned())

        pinned = sum(held(h) + held(h.grad) for h in self.param_d2h_map.values())
        state = sum(
            nbytes(t)
            for opt in self.optim_dict.values()
            for st in opt.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        )
        grads = sum(nbytes(h.grad) for h in self.param_d2h_map.values())
        num_on_device = sum(len(g["params"]) for g in self.d_param_groups)
        return OffloadMemoryReport(
            num_offloaded=len(self.param_d2h_map),
            num_on_device=num_on_device,
            device_bytes_saved=state + (grads if self.offload_gradients else 0),
            host_bytes=pinned + state,
            pinned_bytes=pinned,
        )
