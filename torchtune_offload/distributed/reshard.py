"""Re-sharding the checkpointed states of the engine on FSDP2's shards to another rank count.

:class:`~torchtune_offload.distributed.sharded_offload.ShardedOffloadOptimizer` writes one file per
rank: the engine's state over that rank's local shards, keyed by parameter name. FSDP2 cuts every
parameter on dim 0 as ``torch.chunk`` does, so rank ``k`` of ``N`` holds a contiguous run of rows,
and a state that is kept element by element (torch's AdamW: ``exp_avg``, ``exp_avg_sq``; fp32
master weights) is the same rows of the same tensor. Here each rank builds its state for another
rank count ``M`` by copying, from the old ranks' files in rank order, the rows its new shards
hold; per-tensor scalars (``step``) must be equal on every old rank and are taken once. The
result is the state an ``M``-rank run would hold, bit for bit.

What cannot be cut by rows is refused by name before anything is loaded: a base optimizer whose
update is not elementwise (``OptimizerCapabilities.elementwise_update``; ``torchtune_offload.AdamW8bit``
quantizes its 8-bit states in blocks of 256 elements of each rank's shard, so re-cutting the
shards would requantize them), and any state that is neither shaped as its shard nor a scalar.

A single-device engine's checkpoint (``offload_checkpoint.STATE_DICT_FORMAT``: one file of whole
tensors, or a single-device step checkpoint's training state that holds one) is the ``N = 1`` case.
"""

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchtune_offload.distributed.sharded_offload import SHARDED_STATE_FORMAT
from torchtune_offload.optim.capabilities import capabilities_of
from torchtune_offload.optim.host_buffers import offloads
from torchtune_offload.optim.offload_checkpoint import STATE_DICT_FORMAT

#: The key a slot's master weights are cut under, beside its base optimizer's states (no state has it).
_MASTER = "\0master"


def reshard_fix(ranks: Optional[int]) -> str:
    """The clause that says what to do where a checkpoint's optimizer states cannot continue on this
    run's rank count: resume with the rank count that wrote it (``ranks``; None: the single-device
    recipe), or start fresh from its weights."""
    back = (f"resume with tune run --nproc_per_node {ranks}" if ranks is not None else
            "resume it with the single-device recipe")
    return f"{back}, or start fresh from its weights with resume_from_checkpoint=False in another output_dir."


@dataclass(frozen=True)
class ShardLayout:
    """This rank's part of one parameter: rows ``[start, stop)`` of dim 0 of a tensor of ``global_shape``.

    Attributes:
        global_shape: the whole parameter's shape.
        start: its first row on this rank.
        stop: one past its last row on this rank (``start`` when the rank holds none).
    """

    global_shape: Tuple[int, ...]
    start: int
    stop: int

    @property
    def local_shape(self) -> Tuple[int, ...]:
        return (self.stop - self.start, *self.global_shape[1:])


def shard_layout(name: str, param: torch.Tensor) -> ShardLayout:
    """This rank's rows of ``param``: a DTensor sharded on dim 0 over a 1-D mesh (FSDP2's), or a
    plain tensor, held whole.

    Raises:
        ValueError: for a DTensor sharded otherwise (naming ``name``), or a 0-dim parameter.
    """
    if param.dim() == 0:
        raise ValueError(f"{name}: a 0-dim parameter has no rows to cut; its state cannot be re-sharded.")
    if not isinstance(param, DTensor):
        return ShardLayout(tuple(param.shape), 0, param.shape[0])
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ValueError(f"{name}: sharded as {param.placements} over a {param.device_mesh.ndim}-D mesh; only "
                         "FSDP2's dim-0 shards over one mesh dimension are re-sharded.")
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if tuple(local_shape) != tuple(param.to_local().shape):
        raise ValueError(f"{name}: its local shard is {list(param.to_local().shape)}, not the {list(local_shape)} "
                         "of a torch.chunk cut; its state cannot be re-sharded.")
    start = min(offset[0], param.shape[0])
    return ShardLayout(tuple(param.shape), start, start + local_shape[0])


def shard_layouts(named_params: Iterable[Tuple[str, torch.Tensor]]) -> Dict[str, ShardLayout]:
    """:func:`shard_layout` of every trainable parameter, by name (the engine's keys)."""
    return {name: shard_layout(name, p) for name, p in named_params if p.requires_grad}


def rank_files_problems(paths: Sequence[Path]) -> List[str]:
    """Why the old ranks' files ``paths`` (rank order) cannot be re-sharded, one line a problem
    (empty if they can). Reads each file's structure memory-mapped, one at a time; no tensor is
    copied. Names and shapes against the model are checked by :func:`reshard_engine_state`."""
    problems = _missing(paths)
    if problems:
        return problems
    header: Optional[Dict[str, Any]] = None
    for index, path in enumerate(paths):
        engine, problem = _open(path, index=index, num_ranks=len(paths))
        if problem is None:
            problem = _header_problem(engine, header, path)
        if problem is not None:
            return [problem]
        header = header or {k: v for k, v in engine.items() if k != "state"}  # rank 0's header, not its states
        problems += [p for name, saved in engine["state"].items() for p in [_slot_problem(name, saved, path)] if p]
        if problems:
            return problems
    return problems


def reshard_engine_state(paths: Sequence[Path], *, layouts: Mapping[str, ShardLayout]) -> Dict[str, Any]:
    """This rank's engine state (``OffloadOptimizer.state_dict``'s format) for the shards
    ``layouts`` describes, cut from the old ranks' files ``paths`` (in rank order).

    The old files are read one at a time, memory-mapped (``torch.load(mmap=True)``). At its peak a
    rank holds the states it is building (its own new shards' states, which the engine then keeps:
    torch's loader keeps a state of the parameter's dtype and device as it is; masters are copied
    into the engine's buffers and these freed), one old file's pickled structure, and the pages of
    the rows it copies from that file, read from disk as they are sliced. Never every rank's state.

    A parameter's placement (``offloaded``: host or device) follows the engine's rule for the new
    shard (``host_buffers.offloads`` against the checkpoint's ``minimal_size``); the base
    optimizers' groups are the first old rank's (:func:`resharded_state` takes this run's own
    placement instead).

    Args:
        paths: each old rank's file: ``ShardedOffloadOptimizer.state_dict`` of rank ``k`` at
            ``paths[k]``; or one file of a single-device engine's state.
        layouts: this rank's rows of each trainable parameter (:func:`shard_layouts`).

    Raises:
        ValueError: naming the file, parameter and state that cannot be cut (:func:`rank_files_problems`),
            parameters missing on either side, shapes that differ from the model's, or scalar
            states that differ between the old ranks. Nothing is returned in part.
    """
    missing = _missing(paths)
    if missing:
        _refuse(missing, len(paths))
    header: Optional[Dict[str, Any]] = None
    slots: Dict[str, Dict[str, Any]] = {}
    rows_seen: Dict[str, int] = {}
    for index, path in enumerate(paths):
        engine, problem = _open(path, index=index, num_ranks=len(paths))
        problem = problem or _header_problem(engine, header, path)
        if problem is None:
            problem = _names_problem(engine["state"], layouts, path)
        if problem is not None:
            _refuse([problem], len(paths))
        header = header or {k: v for k, v in engine.items() if k != "state"}
        for name, saved in engine["state"].items():
            problem = _slot_problem(name, saved, path) or _cut(name, saved, layouts[name], slots, rows_seen,
                                                              index=index, path=path)
            if problem is not None:
                _refuse([problem], len(paths))
        del engine  # one old file mapped at a time
    short = [f"{name}: the files hold {rows_seen.get(name, 0)} of its {layouts[name].global_shape[0]} rows"
             for name in layouts if rows_seen.get(name, 0) != layouts[name].global_shape[0]]
    if short:
        _refuse(short, len(paths))
    return {"format": STATE_DICT_FORMAT, "optimizer_class": header["optimizer_class"],
            "minimal_size": header["minimal_size"], "update_on": header.get("update_on", "host"),
            "param_groups": header["param_groups"],
            "state": {name: _finished(slots[name], layouts[name], header) for name in _names(header)}}


def resharded_state(paths: Sequence[Path], *, optimizer: Any, layouts: Mapping[str, ShardLayout],
                    rank: int, world_size: int) -> Dict[str, Any]:
    """What ``optimizer.load_state_dict`` takes on rank ``rank`` of ``world_size``: the old ranks'
    states re-sharded (:func:`reshard_engine_state`), with this run's placement of each parameter.

    Args:
        paths: each old rank's file, in rank order.
        optimizer: this rank's ``ShardedOffloadOptimizer``, built and not yet stepped.
        layouts: this rank's rows of each trainable parameter (:func:`shard_layouts`).
        rank: this rank.
        world_size: this run's rank count.

    Raises:
        ValueError: as :func:`reshard_engine_state`.
    """
    engine = reshard_engine_state(paths, layouts=layouts)
    live = optimizer.engine.state_dict()  # before any step: placements and groups, no states
    outer = set().union(*engine["param_groups"])
    for name, slot in engine["state"].items():
        mine = live["state"].get(name)
        if mine is None:
            continue  # the engine's own check names it
        slot["offloaded"] = mine["offloaded"]
        # Keys the outer groups lack are where the slot steps (the host's fused kernel), not training.
        for group, own in zip(slot["optimizer"]["param_groups"], mine["optimizer"]["param_groups"]):
            group.update({k: v for k, v in own.items() if k not in outer and k != "params"})
    return {"format": SHARDED_STATE_FORMAT, "engine": engine, "rank": rank, "world_size": world_size}


# ----------------------------------------------------------------------------------- reading


def _names(header: Mapping[str, Any]) -> List[str]:
    """The parameter names of an engine state, in its groups' order."""
    return [name for group in header["param_groups"] for name in group["params"]]


def _missing(paths: Sequence[Path]) -> List[str]:
    if not paths:
        return ["no rank file was given"]
    return [f"{path}: rank {k}'s optimizer state is missing" for k, path in enumerate(paths)
            if not Path(path).is_file()]


def _open(path: Path, *, index: int, num_ranks: int) -> Tuple[Any, Optional[str]]:
    """One old rank's engine state, memory-mapped, and why it cannot be used (or None)."""
    # The run's own checkpoint files, read as StepCheckpoints.load reads them: a single-device
    # training state holds numpy's RNG state, which weights_only refuses.
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # any unreadable file: say which and why
        return None, f"{path}: cannot be read ({type(err).__name__}: {err})"
    fmt = saved.get("format") if isinstance(saved, dict) else None
    if fmt == SHARDED_STATE_FORMAT:
        written = (saved.get("rank"), saved.get("world_size"))
        if written != (index, num_ranks):
            return None, (f"{path}: written by rank {written[0]} of {written[1]}, given as rank {index} of "
                          f"{num_ranks}: list every old rank's file, in rank order")
        engine = saved.get("engine")
    elif num_ranks == 1 and fmt == STATE_DICT_FORMAT:
        engine = saved  # a single-device engine's state: whole tensors
    elif num_ranks == 1 and isinstance(saved, dict) and isinstance(saved.get("optimizer"), dict):
        engine = saved["optimizer"]  # a single-device step checkpoint's training state
    else:
        found = fmt or (f"keys {sorted(saved)[:5]}" if isinstance(saved, dict) else type(saved).__name__)
        return None, (f"{path}: not a state of the engine on FSDP2's shards ({found}), nor, alone, a single-device "
                      f"engine's (format {STATE_DICT_FORMAT!r})")
    if not isinstance(engine, dict) or engine.get("format") != STATE_DICT_FORMAT:
        return None, f"{path}: holds no engine state (format {STATE_DICT_FORMAT!r})"
    if not isinstance(engine.get("state"), dict) or not isinstance(engine.get("param_groups"), list):
        return None, f"{path}: its engine state lacks 'state' or 'param_groups': it was damaged or edited"
    return engine, None


def _header_problem(engine: Dict[str, Any], first: Optional[Dict[str, Any]], path: Path) -> Optional[str]:
    """Why ``engine`` cannot be cut: a base optimizer whose update is not elementwise, or a
    header that differs from the first old rank's."""
    if first is None:
        return _class_problem(engine.get("optimizer_class"), path)
    for key in ("optimizer_class", "minimal_size", "update_on"):
        if engine.get(key) != first.get(key):
            return f"{path}: {key} is {engine.get(key)!r} there and {first.get(key)!r} in rank 0's file"
    if _names(engine) != _names(first):
        return f"{path}: its parameters or groups differ from rank 0's file"
    return None


def _class_problem(dotted: Any, path: Path) -> Optional[str]:
    module, _, name = str(dotted).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return f"{path}: its base optimizer {dotted!r} cannot be imported, so its state layout is unknown"
    if not capabilities_of(cls).elementwise_update:
        return (f"{path}: optimizer.optimizer_class={dotted} keeps states that are not element by element "
                "(its capabilities declare no elementwise_update: 8-bit states are quantized in blocks of each "
                "rank's shard, and cutting the shards anew would requantize them), so they cannot be re-sharded")
    return None


def _names_problem(state: Mapping[str, Any], layouts: Mapping[str, ShardLayout], path: Path) -> Optional[str]:
    missing = sorted(set(layouts) - set(state))
    unexpected = sorted(set(state) - set(layouts))
    if missing or unexpected:
        return (f"{path}: its parameters differ from this model's trainable ones (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}); resume with the model that wrote it")
    return None


def _arrays_and_scalars(name: str, saved: Dict[str, Any], path: Path
                        ) -> Tuple[Optional[Dict[str, torch.Tensor]], Dict[str, Any], Optional[str]]:
    """A slot's row-shaped states and its scalars, or why its state cannot be cut."""
    shape = list(saved.get("shape", ()))
    base = saved.get("optimizer")
    states = base.get("state") if isinstance(base, dict) else None
    if not isinstance(states, dict) or len(states) > 1:
        return None, {}, f"{path}: {name}: its base optimizer state is not one parameter's"
    values = next(iter(states.values()), {})
    arrays, scalars = {}, {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and list(value.shape) == shape and value.dim() > 0:
            arrays[key] = value
        elif isinstance(value, (int, float, bool)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
            scalars[key] = value
        else:
            found = (f"{value.dtype}{list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__)
            return None, {}, (f"{path}: {name}: state {key!r} is {found}, neither shaped as the shard {shape} nor "
                              "a scalar, so it cannot be cut by rows")
    return arrays, scalars, None


def _slot_problem(name: str, saved: Any, path: Path) -> Optional[str]:
    if not isinstance(saved, dict) or not isinstance(saved.get("shape"), (list, tuple, torch.Size)) \
            or not saved["shape"] or not isinstance(saved.get("optimizer"), dict):
        return f"{path}: {name}: its entry lacks a shape with rows or an optimizer state"
    master = saved.get("master")
    if master is not None and (not isinstance(master, torch.Tensor) or list(master.shape) != list(saved["shape"])):
        return f"{path}: {name}: its master weights are not shaped as the shard {list(saved['shape'])}"
    return _arrays_and_scalars(name, saved, path)[2]


# ----------------------------------------------------------------------------------- cutting


def _cut(name: str, saved: Dict[str, Any], layout: ShardLayout, slots: Dict[str, Dict[str, Any]],
         rows_seen: Dict[str, int], *, index: int, path: Path) -> Optional[str]:
    """Copies the rows of old rank ``index``'s ``saved`` slot that this rank's ``layout`` holds
    into ``slots[name]``; returns why it cannot (or None)."""
    shape = list(saved["shape"])
    if shape[1:] != list(layout.global_shape[1:]):
        return (f"{path}: {name}: a shard of {shape} there, and the model's parameter is "
                f"{list(layout.global_shape)}")
    lo = rows_seen.get(name, 0)
    hi = rows_seen[name] = lo + shape[0]
    if hi > layout.global_shape[0]:
        return f"{path}: {name}: the files hold more than its {layout.global_shape[0]} rows"
    arrays, scalars, _ = _arrays_and_scalars(name, saved, path)
    if "master" in saved:
        arrays = {**arrays, _MASTER: saved["master"]}
    slot = slots.setdefault(name, {"dtype": saved["dtype"], "groups": saved["optimizer"]["param_groups"],
                                   "index": next(iter(saved["optimizer"]["state"]), 0),
                                   "arrays": None, "scalars": None, "from": index})
    if saved["dtype"] != slot["dtype"]:
        return f"{path}: {name}: {saved['dtype']} there, {slot['dtype']} in rank {slot['from']}'s file"
    if shape[0] == 0:
        return None  # a rank without rows of this parameter: nothing of it to copy or compare
    if slot["arrays"] is None:
        slot["arrays"] = {k: torch.empty(layout.local_shape, dtype=v.dtype) for k, v in arrays.items()}
        slot["scalars"], slot["from"] = dict(scalars), index
    if set(arrays) != set(slot["arrays"]) or set(scalars) != set(slot["scalars"]):
        return (f"{path}: {name}: states {sorted(set(arrays) | set(scalars))} there, "
                f"{sorted(set(slot['arrays']) | set(slot['scalars']))} in rank {slot['from']}'s file")
    for key, value in scalars.items():
        if not _same(value, slot["scalars"][key]):
            return (f"{path}: {name}: state {key!r} is {value!r} there and {slot['scalars'][key]!r} in rank "
                    f"{slot['from']}'s file; a per-tensor scalar must agree across ranks")
    begin, end = max(lo, layout.start), min(hi, layout.stop)
    if begin < end:
        for key, value in arrays.items():
            if value.dtype != slot["arrays"][key].dtype:
                return f"{path}: {name}: state {key!r} is {value.dtype} there, another dtype elsewhere"
            slot["arrays"][key][begin - layout.start:end - layout.start].copy_(value[begin - lo:end - lo])
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and torch.equal(a, b)
    return a == b


def _finished(slot: Dict[str, Any], layout: ShardLayout, header: Mapping[str, Any]) -> Dict[str, Any]:
    """One slot of the new engine state."""
    arrays = dict(slot["arrays"] or {})
    master = arrays.pop(_MASTER, None)
    scalars = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in (slot["scalars"] or {}).items()}
    states = {slot["index"]: {**scalars, **arrays}} if arrays or scalars else {}
    probe = torch.empty(layout.local_shape, device="meta")
    placed = header.get("update_on", "host") == "host" and offloads(probe, header["minimal_size"])
    entry = {"offloaded": placed, "shape": list(layout.local_shape), "dtype": slot["dtype"],
             "optimizer": {"state": states, "param_groups": [dict(g) for g in slot["groups"]]}}
    if master is not None:
        entry["master"] = master
    return entry


def _refuse(problems: List[str], num_ranks: int) -> None:
    raise ValueError(f"optimizer states written by {num_ranks} rank(s) cannot be re-sharded:\n  - "
                     + "\n  - ".join(problems) + "\nTo continue, " + reshard_fix(num_ranks))
