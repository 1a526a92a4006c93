"""``OffloadOptimizer``'s checkpoints: keyed by parameter name, with each slot's placement and
master weights, and checked against the optimizer before anything loads."""

from typing import AbstractSet, Any, Dict, List, Optional, Tuple

import torch

import torchtune_offload.optim.stream_check as stream_check
from torchtune_offload.optim.param_table import ParameterTable, Slot
from torchtune_offload.optim.state_plan import state_layout
from torchtune_offload.optim.state_streamer import StateStreamer

STATE_DICT_FORMAT = "torchtune_offload.OffloadOptimizer/1"


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def state_dict(table: ParameterTable, param_groups: List[Dict[str, Any]], *, base_class: type) -> Dict[str, Any]:
    """The checkpoint of an optimizer whose host work is finished (see ``OffloadOptimizer.state_dict``)."""
    groups = []
    for gi, group in enumerate(param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [s.key for s in table.slots if s.group_index == gi]})
    return {
        "format": STATE_DICT_FORMAT,
        "optimizer_class": class_path(base_class),
        "minimal_size": table.minimal_size,
        "update_on": table.update_on,
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
            for s in table.slots
        },
    }


#: What to do about a checkpoint that does not fit.
_FIX = ("Resume with the model, optimizer_class, parameter groups and minimal_size that wrote it, or start "
        "without resume_from_checkpoint.")


def load_state_dict(table: ParameterTable, param_groups: List[Dict[str, Any]], sd: Any, *,
                    base_class: type, streamer: StateStreamer, fp8_slots: AbstractSet[int] = frozenset()) -> None:
    """Restores ``sd`` into the slots and ``param_groups`` after checking that it fits; streamed
    slots' states go straight into their host buffers through ``streamer``. The device weights of
    ``fp8_slots`` (slot indexes) are FP8 images, left for the caller to re-quantize.

    Raises:
        ValueError: listing every mismatch; nothing is loaded in that case.
    """
    problems = mismatches(table, sd, base_class=base_class, num_groups=len(param_groups))
    if not problems:
        problems = [p for s in table.streamed for p in [streamer.load_problem(s, sd["state"][s.key]["optimizer"])] if p]
    if not problems:
        problems = _state_shape_problems(table, sd["state"])
    if problems:
        raise ValueError(
            "optimizer checkpoint does not fit this model and optimizer:\n  - "
            + "\n  - ".join(problems)
            + "\n" + _FIX
        )
    _load_base_states(table, sd["state"])
    for group, saved in zip(param_groups, sd["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for slot in table.slots:
        saved = sd["state"][slot.key]
        if slot.streamed:
            streamer.load(slot, saved["optimizer"])
        if slot.has_master:
            with torch.no_grad():
                slot.step_param.copy_(saved["master"])
                # The parameter becomes the master's rounding, as after a step (an FP8 device
                # image is re-quantized by the caller instead).
                if slot.index not in fp8_slots:
                    slot.param.copy_(slot.step_param)


def _state_shape_problems(table: ParameterTable, saved_state: Dict[str, Any]) -> List[str]:
    """Base optimizer states (not streamed: the streamer checks its own) whose shapes differ from
    those the base optimizer makes for the parameter, probed on meta tensors once per class, group,
    shape and dtype. torch's optimizers load such a state without a word and fail at the first step
    with a kernel's shape error that names no parameter; an optimizer that cannot step on meta
    tensors is left to its own loader."""
    layouts: Dict[Tuple[int, torch.Size, torch.dtype], Optional[Dict[str, torch.Size]]] = {}
    problems = []
    for slot in table.slots:
        saved = saved_state[slot.key]["optimizer"].get("state", {})
        if slot.streamed or not isinstance(saved, dict) or len(saved) != 1:
            continue
        arrays = next(iter(saved.values()))
        shapes = _probed_shapes(table, slot, layouts)
        if not isinstance(arrays, dict) or shapes is None:
            continue
        for key, value in arrays.items():
            if isinstance(value, torch.Tensor) and key in shapes and value.shape != shapes[key]:
                problems.append(f"{slot.key}: optimizer state {key!r} is {list(value.shape)} in the checkpoint, "
                                f"{slot.optimizer.__class__.__name__} keeps {list(shapes[key])} for this parameter")
    return problems


def _probed_shapes(table: ParameterTable, slot: Slot,
                   cache: Dict[Tuple[int, torch.Size, torch.dtype], Optional[Dict[str, torch.Size]]]
                   ) -> Optional[Dict[str, torch.Size]]:
    """The array states' shapes the slot's base optimizer makes (the streamer's probe), or None
    where it cannot step on meta tensors."""
    key = (slot.group_index, slot.step_param.shape, slot.step_param.dtype)
    if key not in cache:
        try:
            layout, _ = state_layout(type(slot.optimizer), table.group_options[slot.group_index], slot.step_param)
        except ValueError:  # the optimizer cannot step on meta tensors: only its own loader checks
            layout = None
        cache[key] = None if layout is None else {k: torch.Size(shape) for k, shape, _ in layout}
    return cache[key]


def _load_base_states(table: ParameterTable, saved_state: Dict[str, Any]) -> None:
    """Loads each slot's base optimizer state (streamed slots' are the streamer's), all or none: a
    base optimizer refusing its state (``AdamW8bit`` saved with another ``min_8bit_size``, say)
    puts back the states and groups of those loaded before it. Loading replaces a base
    optimizer's ``state`` and ``param_groups`` with new objects and writes into neither, so
    holding the old ones is enough to put them back (at resume they are empty: states are made at
    the first step, so holding them costs no memory then).

    Raises:
        ValueError: naming the parameter whose base optimizer refused its state, and why.
    """
    loaded = []
    for slot in table.slots:
        if slot.streamed:
            continue
        optimizer = slot.optimizer
        before = (optimizer, optimizer.state, optimizer.param_groups)
        try:
            optimizer.load_state_dict(saved_state[slot.key]["optimizer"])
        except Exception as err:
            for base, state, groups in loaded:
                base.__setstate__({"state": state, "param_groups": groups})
            if not isinstance(err, (ValueError, KeyError, TypeError)):
                raise  # not the checkpoint's fault (out of memory, say): as it is, the states put back
            raise ValueError(f"optimizer checkpoint does not fit this model and optimizer: {slot.key}: "
                             f"{str(err).rstrip('.')}. Nothing was loaded. {_FIX}") from err
        loaded.append(before)
    for slot in table.offloaded:
        # Loaded states of a host step live in host memory (what the stream checker must know).
        for value in slot.optimizer.state.get(slot.step_param, {}).values():
            if isinstance(value, torch.Tensor):
                stream_check.host_tensor(value)


def mismatches(table: ParameterTable, sd: Any, *, base_class: type, num_groups: int) -> List[str]:
    """Why ``sd`` cannot be loaded into ``table``'s optimizer, one line per problem (empty if it can)."""
    if not isinstance(sd, dict) or sd.get("format") != STATE_DICT_FORMAT:
        found = sd.get("format", "no 'format' entry") if isinstance(sd, dict) else type(sd).__name__
        return [
            f"it is not an OffloadOptimizer checkpoint ({found}); it was written by another "
            f"optimizer (expected format {STATE_DICT_FORMAT!r})"
        ]
    damaged = _damaged_entries(sd)
    if damaged:
        # An entry of the wrong kind is listed with the kind it needs: "state['w']['shape'] (a list)".
        return [f"it is an OffloadOptimizer checkpoint with entries missing ({', '.join(damaged[:5])}): it was "
                "damaged or edited; resume from an earlier checkpoint"]
    problems = []
    mine = class_path(base_class)
    if sd["optimizer_class"] != mine:
        problems.append(f"optimizer_class: checkpoint {sd['optimizer_class']}, now {mine}")
    # Checkpoints from before update_on existed were all updated on the host.
    if sd.get("update_on", "host") != table.update_on:
        problems.append(f"update_on: checkpoint {sd.get('update_on', 'host')}, now {table.update_on} (the "
                        "states are laid out differently; resume with the update_on that wrote it)")
    saved_state = sd["state"]
    missing = [s.key for s in table.slots if s.key not in saved_state]
    unexpected = [k for k in saved_state if k not in table.slot_of_key]
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:5]}")
    if unexpected:
        problems.append(f"parameters in the checkpoint but not trainable here: {unexpected[:5]}")
    for slot in table.slots:
        problem = _slot_mismatch(table, slot, saved_state.get(slot.key), saved_minimal_size=sd["minimal_size"])
        if problem:
            problems.append(problem)
    saved_groups = [g["params"] for g in sd["param_groups"]]
    my_groups = [[s.key for s in table.slots if s.group_index == gi] for gi in range(num_groups)]
    if not problems and saved_groups != my_groups:
        problems.append("parameter groups differ (same parameters, grouped or ordered differently)")
    return problems


#: What every checkpoint of this format holds, at its top and for each parameter.
_ENTRIES = ("optimizer_class", "minimal_size", "param_groups", "state")
_SLOT_ENTRIES = ("offloaded", "shape", "dtype", "optimizer")


def _damaged_entries(sd: Dict[str, Any]) -> List[str]:
    """The entries a checkpoint of this format must hold and ``sd`` lacks (or holds as the wrong
    kind of value), as ``key`` paths."""
    missing = [key for key in _ENTRIES if key not in sd]
    if not isinstance(sd.get("state", {}), dict) or not isinstance(sd.get("param_groups", []), list):
        return missing + ["state (a dict) or param_groups (a list)"]
    missing += [f"param_groups[{i}]['params']" for i, g in enumerate(sd.get("param_groups", []))
                if not isinstance(g, dict) or "params" not in g]
    for name, saved in sd.get("state", {}).items():
        if not isinstance(saved, dict):
            missing.append(f"state[{name!r}] (a dict)")
            continue
        missing += [f"state[{name!r}][{key!r}]" for key in _SLOT_ENTRIES if key not in saved]
        if not isinstance(saved.get("shape", ()), (list, tuple, torch.Size)):
            missing.append(f"state[{name!r}]['shape'] (a list)")
        if not isinstance(saved.get("optimizer", {}), dict):
            missing.append(f"state[{name!r}]['optimizer'] (a dict)")
    return missing


def _slot_mismatch(table: ParameterTable, slot: Any, saved: Optional[Dict[str, Any]], *,
                   saved_minimal_size: int) -> Optional[str]:
    if saved is None:
        return None
    if list(saved["shape"]) != list(slot.param.shape) or saved["dtype"] != str(slot.param.dtype):
        return (f"{slot.key}: checkpoint {saved['dtype']}{list(saved['shape'])}, "
                f"model {slot.param.dtype}{list(slot.param.shape)}")
    if ("master" in saved) != slot.has_master:
        return (f"{slot.key}: {'has' if 'master' in saved else 'has no'} master weights in the "
                f"checkpoint, {'needs' if slot.has_master else 'takes none'} now "
                f"(master_dtype={table.master_dtype})")
    master = saved.get("master")
    if slot.has_master and (not isinstance(master, torch.Tensor) or master.shape != slot.step_param.shape
                            or master.dtype != slot.step_param.dtype):
        found = f"{master.dtype}{list(master.shape)}" if isinstance(master, torch.Tensor) else type(master).__name__
        return (f"{slot.key}: master weights in the checkpoint are {found}, "
                f"need {slot.step_param.dtype}{list(slot.step_param.shape)}")
    if saved["offloaded"] != slot.offloaded:
        return (f"{slot.key}: stepped {'on the host' if saved['offloaded'] else 'on the device'} "
                f"in the checkpoint (minimal_size={saved_minimal_size}), "
                f"{'on the host' if slot.offloaded else 'on the device'} now "
                f"(minimal_size={table.minimal_size})")
    return None
