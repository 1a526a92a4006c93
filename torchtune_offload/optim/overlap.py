"""The machinery that lets ``OffloadOptimizer(overlap=True)`` run host steps beside GPU work.

A caller announces the backward that ends an accumulation window
(``OffloadOptimizer.expect_final_backward``). During that backward each offloaded parameter's
final gradient is sent to the host as soon as its hand-off group (``handoff.py``: a transformer
layer or a bucket of other parameters) is complete, and host worker threads take over from there:

- the *landing* threads (as many as torch's intra-op threads) each take a job of gradients (a
  hand-off group's, or with clipping several groups'; at most ``overlap_scheduler.LANDING_BYTES``, a
  large matrix alone), wait for their copies, fold their staged micro-batches into the host sums, and
  measure the norms not measured on the device; several land at once because torch measures a host
  tensor's norm on one core;
- the *step* thread runs the base optimizer on the host copy and sends the new weights back.

Without clipping a parameter's step is queued as soon as it has landed, while backward goes on.
With clipping the total norm is known only when every gradient has landed, so the steps are
queued by ``step()``, in the order the next forward uses the parameters (the reverse of the order
backward produced them). Either way ``step()`` returns at once and the next forward waits, module
by module, for its own parameters only (``OffloadOptimizer.register_forward_waits``).

The math is that of the serial path: the same tensors, the same operations, in the same order
per tensor. Only the moment each runs changes.
"""

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.handoff import layer_prefix


class HostWorkers:
    """The host worker threads: a few land gradients, a job of a few at a time each, and one steps,
    in the order it was given (while streams are checked, each task is a host agent of the checker, ordered by its
    future).

    Args:
        landing_threads: how many landing jobs may run at once (default: torch's intra-op threads,
            the host's cores). Their norms are the work: one core each, memory-bound together.
    """

    def __init__(self, *, landing_threads: Optional[int] = None) -> None:
        threads = torch.get_num_threads() if landing_threads is None else landing_threads
        self._landing = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="offload-landing")
        self._stepping = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-host-step")

    def land(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues ``fn(*args)`` for the next free landing thread."""
        return stream_check.submit(self._landing, fn, *args)

    def step(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queues ``fn(*args)`` on the step thread."""
        return stream_check.submit(self._stepping, fn, *args)

    def shutdown(self) -> None:
        """Finishes what is queued and stops both threads."""
        self._landing.shutdown(wait=True)
        self._stepping.shutdown(wait=True)


def hyperparameters(param_groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """A snapshot of every group's options, without the parameters."""
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in param_groups]


def changed_hyperparameters(before: List[Dict[str, Any]], after: List[Dict[str, Any]]) -> List[str]:
    """``group[i].key`` for every option that differs between two snapshots."""
    changed = []
    for i, (old, new) in enumerate(zip(before, after)):
        for key in sorted(set(old) | set(new)):
            a, b = old.get(key), new.get(key)
            same = (torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                    else type(a) is type(b) and a == b)
            if not same:
                changed.append(f"param_groups[{i}].{key}: {a!r} -> {b!r}")
    return changed


@dataclass
class Window:
    """The accumulation window whose final backward was announced, until its ``step()``.

    Attributes:
        clipping: the caller will clip (or measure) the gradients before ``step()``, so host steps
            wait for ``step()`` instead of starting as gradients land.
        hyper: the hyper-parameters when the window was announced; without clipping the steps
            use these, and ``step()`` checks that nothing changed them.
        order: slot indices in the order the final backward produced their gradients.
        seen: slot indices whose gradients are part of the window's record (hooked or stragglers).
        stragglers: slot indices with gradients from earlier micro-batches only.
        coef: the clipping factor, once ``clip_grad_norm_`` has computed it.
    """

    clipping: bool
    hyper: List[Dict[str, Any]]
    order: List[int] = field(default_factory=list)
    seen: Set[int] = field(default_factory=set)
    stragglers: List[int] = field(default_factory=list)
    coef: Optional[torch.Tensor] = None


# A compiled module (compile=True) runs this eagerly instead of tracing waits on threads or streams.
@torch.compiler.disable
def _wait_for(wait: Callable[[List[Any]], None], slots: List[Any], _module: torch.nn.Module, _args: Any) -> None:
    wait(slots)


def register_module_waits(model: torch.nn.Module, own: Callable[[torch.nn.Parameter], Optional[Any]],
                          wait: Callable[[List[Any]], None], synchronize: Callable[[], None], *,
                          units: Optional[Sequence[Tuple[torch.nn.Module, Sequence[torch.nn.Parameter]]]] = None,
                          ) -> Tuple[List[Any], List[Any]]:
    """Makes each transformer layer of ``model`` (a module named ``...layers.<i>``) call ``wait(slots)``
    with all its parameters' slots right before its forward, each other module for its own
    parameters' slots, and ``model.state_dict()`` call ``synchronize()`` first.

    One wait per layer, on the outermost module of that name: with torchtune's activation
    checkpointing that is the checkpoint wrapper, outside the layer that ``compile: True`` compiles;
    without it, the compiled layer's own pre-hook, which dynamo runs without a graph break
    (tests/recipe/test_compile.py). Waits on the layer's inner modules (its projections) would split
    its graph, and change its kernels.

    Args:
        model: the model whose forward needs the results.
        own: the slot of a parameter whose work the forward must wait for, or None.
        wait: waits for the queued work of a list of slots (one module's).
        synchronize: waits for all of it.
        units: instead of the walk above, the modules that wait and the parameters each waits for,
            in forward order: each wait runs before every other pre-forward hook of its module (an
            FSDP2 unit all-gathers its parameters in its own pre-forward hook, which must read
            updated shards; ``distributed/sharded_offload.py``).

    Returns:
        The hook handles, and the slots in the order of the modules that own them (the order of
        ``model.modules()``, the forward's for torchtune's models).
    """
    # FSDP2's unit all-gathers in its own pre-forward hook: the wait goes before it.
    prepend = units is not None
    handles, ordered, seen = [], [], set()
    for module, params in layer_units(model) if units is None else units:
        slots = list(dict.fromkeys(slot for slot in map(own, params) if slot is not None))
        if slots:
            ordered.extend(slot for slot in slots if slot not in seen)
            seen.update(slots)
            handles.append(module.register_forward_pre_hook(functools.partial(_wait_for, wait, slots), prepend=prepend))
    handles.append(model.register_state_dict_pre_hook(lambda *_args, **_kwargs: synchronize()))
    return handles, ordered


def layer_units(model: torch.nn.Module) -> List[Tuple[torch.nn.Module, List[torch.nn.Parameter]]]:
    """The modules of ``model`` that wait, in ``model.modules()`` order, each with the parameters it
    waits for: a transformer layer (the outermost module named ``...layers.<i>``) all of its own and
    its modules', any other module outside a layer its own."""
    units = []
    layer = None  # the name of the layer being walked, whose modules its own wait covers
    for name, module in model.named_modules():
        if layer is not None and name.startswith(layer + "."):
            continue
        layer = name if name and layer_prefix(name) == name else None
        units.append((module, list(module.parameters(recurse=layer is not None))))
    return units
