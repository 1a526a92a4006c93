"""Several parameters stepped by one call of one base optimizer.

torch's optimizers step the tensors of a parameter group one by one (the single-tensor loop), or in
one multi-tensor (``foreach``) or fused kernel call; either way each tensor's arithmetic is its own.
The engine keeps one base optimizer per parameter (its slot), and a call of ``step`` costs tens of
microseconds of wrapper Python before any arithmetic: for slots of one optimizer class that declares
``steps_tensors_apart`` (``optim/capabilities.py``) and of one parameter group, lending the first
slot's optimizer all of their parameters and states for one call gives each slot the update its own
optimizer would have made, for one call's Python. The host step steps each module's offloaded slots
this way; the state streamer its staged runs, by its own rule (whole slots of an elementwise update,
``StateStreamer._batch_key``).

Each slot's options are its own optimizer's (single-tensor loop, ``foreach`` or fused, as built):
the multi-tensor loop is not chosen in its place, as on the CPU torch's ``_foreach_mul_`` rounds a
scalar to a bfloat16 tensor's dtype before multiplying where ``Tensor.mul_`` multiplies in float
(0.95 times bfloat16 0.89453125 gives 0.84765625 against 0.8515625), which would change plain
AdamW's bits on bfloat16 parameters.
"""

from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence

import torch

def step_together(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor],
                  states: Sequence[Dict[str, Any]], **step_options: Any) -> List[Dict[str, Any]]:
    """Steps ``params`` (their ``.grad`` set) with one ``step`` call of ``optimizer``, whose one
    parameter group's options apply to all of them, each from its state in ``states``.

    The optimizer's own parameters and state are as before once it returns, whether the step raised
    or not.

    Args:
        optimizer: a base optimizer with one parameter group.
        params: the parameters to step.
        states: each parameter's state (an empty dict for one not stepped yet, which the step fills).
        **step_options: for ``optimizer.step`` (AdamW8bit's ``grad_scale``).

    Returns:
        each parameter's state after the step: the dict given, unless the optimizer replaced it.
    """
    group = optimizer.param_groups[0]
    own_params, own_state = group["params"], dict(optimizer.state)
    group["params"] = list(params)
    optimizer.state.clear()
    for param, state in zip(params, states):
        optimizer.state[param] = state
    try:
        optimizer.step(**step_options)
        return [optimizer.state[param] for param in params]
    finally:
        group["params"] = own_params
        optimizer.state.clear()
        optimizer.state.update(own_state)


def runs(items: Sequence[Any], *, key: Callable[[Any], Optional[tuple]], nbytes: Callable[[Any], int],
         bound: int) -> List[List[Any]]:
    """``items`` cut into runs, in their order: consecutive items of one ``key`` (None: alone) whose
    ``nbytes`` add up to at most ``bound`` (a larger item alone)."""
    out: List[List[Any]] = []
    current, size = None, 0
    for item in items:
        this, need = key(item), nbytes(item)
        if this is None or this != current or size + need > bound:
            out.append([])
            current, size = this, 0
        out[-1].append(item)
        size += need
    return out


def first_of_each(items: Iterable[Any], *, key: Callable[[Any], Any]) -> Iterator[Any]:
    """The items whose ``key`` is another object than the previous item's: one item per run that
    shares a key (the slots of one job share its future, of one launch its event)."""
    previous = object()
    for item in items:
        this = key(item)
        if this is not previous:
            previous = this
            yield item
