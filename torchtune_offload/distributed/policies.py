"""Which modules FSDP2 shards as units of their own, chosen from YAML by name or by class.

FSDP2 all-gathers a unit's parameters just before the unit runs and frees them afterwards. A module
that is no unit of its own belongs to the nearest enclosing unit, and whatever no unit claims
belongs to the root unit. The root is special: it is gathered when the forward starts and freed
only when the backward ends, because its parameters are needed again right away. In a decoder the
root therefore keeps the unsharded token embedding *and* the unsharded output projection alive
through forward and backward, and the output projection's full gradient from the start of the
backward to its end. Giving each of them a unit of its own gathers each one only around its own
use, which is where torchtune PR #865's savings come from (measured here: docs/fsdp_memory.md).

A *policy* is a plain callable ``(name, module) -> bool``: True makes the module a unit. Built in:

- :func:`layers` (the default): every ``layers.<i>`` of a decoder.
- :func:`embeddings`: the token embedding (any ``nn.Embedding``) and the output projection (the
  module named ``output``).
- :class:`NamePattern`: ``re.fullmatch`` on the module's qualified name.
- :class:`ModuleClass`: ``isinstance`` of a class, given as a class or a dotted path.
- :class:`AnyOf`: composition; a YAML list means the same.

In YAML, ``fsdp_shard_policy`` is a list whose items are built-in names or one-key dicts::

    fsdp_shard_policy:
      - layers
      - embeddings                          # token embedding + output projection
      - name_pattern: 'layers\\.\\d+\\.mlp' # regex, full match on the qualified name
      - module_class: torchtune.modules.TransformerSelfAttentionLayer

Absent or null means ``[layers]``. torchtune's ``custom_sharded_layers: [tok_embeddings, output]``
keeps its meaning: each entry is an exact module name, added to the policy (to ``[layers]`` when
``fsdp_shard_policy`` is absent).

Rules:

- Every item must match at least one module of the model, else ``ValueError`` names the item.
- Names are the model's own (state-dict) names: activation checkpointing's wrappers are looked
  through, so ``layers.0`` and ``TransformerSelfAttentionLayer`` select the same unit with or
  without ``enable_activation_checkpointing``, and the unit is the outermost (wrapping) module.
- Tied weights: a weight read by modules in two places (llama3_2 and small qwen2_5 read
  ``tok_embeddings.weight`` again in their output projection through ``TiedLinear``) can only be
  sharded by a unit that contains every place that reads it; a smaller unit frees the weight
  before its second use, and the forward then fails on a sharded weight. Such modules are left to
  the enclosing unit (for a decoder: the root) and reported in :attr:`ShardPlan.skipped`. With tied
  embeddings the ``embeddings`` policy therefore changes nothing: the one shared matrix stays in
  the root, where it is needed from the first layer to the last.

"""

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

from omegaconf import DictConfig, ListConfig, OmegaConf
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torchtune.config._utils import _get_component_from_path

Policy = Callable[[str, Any], bool]

_WRAPPED = "_checkpoint_wrapped_module"
_LAYER_NAME = re.compile(r"(?:.*\.)?layers\.\d+")


def layers(name: str, module: Any) -> bool:
    """Each transformer layer: modules named ``layers.<i>`` (or ``<prefix>.layers.<i>``)."""
    return _LAYER_NAME.fullmatch(name) is not None


def embeddings(name: str, module: Any) -> bool:
    """The token embedding (an ``nn.Embedding``) and the output projection (named ``output``)."""
    return isinstance(module, nn.Embedding) or name.rsplit(".", 1)[-1] == "output"


@dataclass(frozen=True)
class NamePattern:
    """Modules whose qualified name matches ``pattern`` in full (``re.fullmatch``)."""

    pattern: str

    def __post_init__(self) -> None:
        re.compile(self.pattern)  # raises re.error here rather than at the first call

    def __call__(self, name: str, module: Any) -> bool:
        return re.fullmatch(self.pattern, name) is not None

    @property
    def label(self) -> str:
        return f"{{name_pattern: {self.pattern!r}}}"


@dataclass(frozen=True)
class ModuleClass:
    """Modules that are instances of ``cls`` (a class, or a dotted path to one)."""

    cls: Union[type, str]

    def __post_init__(self) -> None:
        if isinstance(self.cls, str):
            object.__setattr__(self, "cls", _get_component_from_path(self.cls))
        if not (isinstance(self.cls, type) and issubclass(self.cls, nn.Module)):
            raise TypeError(f"{self.cls!r} is not an nn.Module subclass")

    def __call__(self, name: str, module: Any) -> bool:
        return isinstance(module, self.cls)

    @property
    def label(self) -> str:
        return f"{{module_class: {self.cls.__module__}.{self.cls.__qualname__}}}"


@dataclass(frozen=True)
class AnyOf:
    """Modules that any of ``policies`` selects."""

    policies: Tuple[Policy, ...]

    def __call__(self, name: str, module: Any) -> bool:
        return any(p(name, module) for p in self.policies)


def any_of(*policies: Policy) -> AnyOf:
    """Composes policies: a module is a unit if any of them selects it."""
    return AnyOf(tuple(policies))


BUILTIN: Dict[str, Policy] = {"layers": layers, "embeddings": embeddings}
DEFAULT_POLICY: Tuple[Policy, ...] = (layers,)


def describe(policy: Policy) -> str:
    """A short label for error messages and logs."""
    for key, builtin in BUILTIN.items():
        if policy is builtin:
            return key
    return getattr(policy, "label", None) or getattr(policy, "__name__", None) or repr(policy)


# ------------------------------------------------------------------------------- from YAML


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def policy_problems(
    spec: Any, *, custom_sharded_layers: Any = None
) -> Tuple[List[Policy], List[str]]:
    """Reads ``fsdp_shard_policy`` and ``custom_sharded_layers`` into policies.

    Returns:
        ``(policies, problems)``: one policy per item, and one message per invalid item, each
        naming the key and index.
    """
    spec = _plain(spec)
    custom = _plain(custom_sharded_layers)
    problems: List[str] = []
    policies: List[Policy] = []
    if spec is None:
        policies.extend(DEFAULT_POLICY)
    else:
        items = [spec] if isinstance(spec, (str, dict)) else spec
        if not isinstance(items, list) or not items:
            problems.append(
                f"fsdp_shard_policy={spec!r}: give a non-empty list such as [layers] or "
                "[layers, embeddings] (or remove the key for the default [layers])."
            )
            items = []
        for i, item in enumerate(items):
            try:
                policies.append(_policy_from_item(item))
            except (ValueError, TypeError, re.error) as err:
                problems.append(f"fsdp_shard_policy[{i}]={item!r}: {err}")
    if custom is not None:
        if not isinstance(custom, list) or not all(isinstance(n, str) and n for n in custom):
            problems.append(
                f"custom_sharded_layers={custom!r}: must be a list of module names, e.g. "
                "[tok_embeddings, output]; or use fsdp_shard_policy."
            )
        else:
            policies.extend(NamePattern(re.escape(n)) for n in custom)
    return policies, problems


def _policy_from_item(item: Any) -> Policy:
    if isinstance(item, str):
        if item in BUILTIN:
            return BUILTIN[item]
        raise ValueError(
            f"unknown built-in policy; use one of {sorted(BUILTIN)}, or a dict "
            "{name_pattern: <regex>} or {module_class: <dotted.path.Class>}."
        )
    if isinstance(item, dict) and len(item) == 1:
        (key, value), = item.items()
        if key == "name_pattern" and isinstance(value, str):
            return NamePattern(value)
        if key == "module_class" and isinstance(value, str):
            try:
                return ModuleClass(value)
            except TypeError:
                raise
            except Exception as err:  # torchtune's InstantiationError, ImportError, ...
                raise ValueError(f"does not resolve to a class ({err})") from err
    raise ValueError(
        "expected a built-in name (layers, embeddings) or a dict with one key, "
        "name_pattern: <regex> or module_class: <dotted.path.Class>."
    )


def parse_shard_policy(spec: Any, *, custom_sharded_layers: Any = None) -> List[Policy]:
    """Like :func:`policy_problems`, but raises.

    Raises:
        ValueError: listing every invalid item.
    """
    policies, problems = policy_problems(spec, custom_sharded_layers=custom_sharded_layers)
    if problems:
        raise ValueError("Invalid FSDP shard policy:\n  - " + "\n  - ".join(problems))
    return policies


def shard_policy_of(cfg: Any) -> List[Policy]:
    """The shard policy a recipe config asks for (its ``fsdp_shard_policy`` and
    ``custom_sharded_layers``), parsed by :func:`parse_shard_policy`.

    Raises:
        ValueError: listing every invalid item.
    """
    return parse_shard_policy(cfg.get("fsdp_shard_policy"), custom_sharded_layers=cfg.get("custom_sharded_layers"))


# ---------------------------------------------------------------------------------- plan


@dataclass
class ShardPlan:
    """What :func:`shard_model` shards.

    Attributes:
        units: qualified names of the modules that get a unit of their own, innermost first
            (the order ``fully_shard`` must see them in); the root follows them.
        skipped: modules a policy selected that stay in an enclosing unit, with the reason.
        matches: for each policy, by label, the names it selected.
    """

    units: List[str]
    skipped: Dict[str, str] = field(default_factory=dict)
    matches: Dict[str, List[str]] = field(default_factory=dict)


def _normal_name(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != _WRAPPED)


def _candidates(model: nn.Module) -> Dict[str, Tuple[nn.Module, Any]]:
    """Normalised name -> (outermost module of that name, innermost module or tied projection)."""
    out: Dict[str, Tuple[nn.Module, Any]] = {}
    for name, module in model.named_modules():
        key = _normal_name(name)
        outer = out[key][0] if key in out else module
        out[key] = (outer, module)
    for user, attr, tied in _tied_projections(model):
        out.setdefault(f"{user}.{attr}" if user else attr, (None, tied))
    out.pop("", None)
    return out


def _tied_projections(model: nn.Module) -> Iterator[Tuple[str, str, Any]]:
    """(user name, attribute, projection) for each non-module projection reading another module's
    weight, as torchtune's ``TiedLinear`` does (it holds the module in ``tied_module``)."""
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(getattr(value, "tied_module", None), nn.Module):
                yield _normal_name(name), attr, value


def _tie_groups(model: nn.Module) -> List[Set[str]]:
    """Sets of module names that read one shared weight."""
    names = {id(m): _normal_name(n) for n, m in model.named_modules()}
    owners: Dict[int, Set[str]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(_normal_name(module_name))
    groups = [g for g in owners.values() if len(g) > 1]
    for user, _, tied in _tied_projections(model):
        groups.append({user, names[id(tied.tied_module)]})
    return groups


def _common_ancestor(names: Set[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    prefix = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix)


def _contains(outer: str, inner: str) -> bool:
    return outer == "" or inner == outer or inner.startswith(outer + ".")


def plan_shard(model: nn.Module, policy: Union[Policy, Sequence[Policy]]) -> ShardPlan:
    """Decides the units without sharding anything (the model may be on the meta device).

    Args:
        model: the model to shard.
        policy: one policy or a list of them; each must select at least one module.

    Raises:
        ValueError: naming every policy that selects no module of ``model``.
    """
    policies = [policy] if callable(policy) else list(policy)
    candidates = _candidates(model)
    matches: Dict[str, List[str]] = {}
    selected: List[str] = []
    for p in policies:
        hits = [name for name, (_, inner) in candidates.items() if p(name, inner)]
        matches[describe(p)] = hits
        selected.extend(h for h in hits if h not in selected)
    unmatched = [label for label, hits in matches.items() if not hits]
    if unmatched:
        sample = [n for n in candidates if n.count(".") <= 1][:12]
        raise ValueError(
            f"fsdp_shard_policy: {', '.join(unmatched)} selects no module of {type(model).__name__}; "
            f"a policy that matches nothing is almost surely a typo. Module names look like {sample}."
        )
    skipped: Dict[str, str] = {}
    for name in selected:
        if candidates[name][0] is None:
            skipped[name] = (
                "a tied projection, not a module: it reads another module's weight and runs in "
                "the unit of the module that calls it"
            )
    for group in _tie_groups(model):
        scope = _common_ancestor(group)
        where = f"'{scope}'" if scope else "the root unit"
        for name in selected:
            if name in skipped or name == scope or not _contains(scope, name):
                continue
            others = sorted(g or "<root>" for g in group if not _contains(name, g))
            if others and any(_contains(name, g) for g in group):
                skipped[name] = (
                    f"its weight is also read by {others}; it stays in {where}, which contains "
                    "every use"
                )
    order = {name: i for i, name in enumerate(candidates)}
    units = sorted((n for n in selected if n not in skipped), key=lambda n: -order[n])
    return ShardPlan(units=units, skipped=skipped, matches=matches)


def shard_model(
    model: nn.Module,
    *,
    policy: Union[Policy, Sequence[Policy]],
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
    mesh: Optional[Any] = None,
) -> ShardPlan:
    """Applies FSDP2's ``fully_shard`` to the units ``policy`` selects, innermost first, then to
    the root, always (with one rank too, so one code path serves every world size).

    Args:
        model: the model, on the meta device or materialised.
        policy: one policy or a list of them (see the module docstring).
        cpu_offload: FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and optimizer
            state live in host memory and the optimizer steps there.
        reshard_after_forward: free gathered parameters after each unit's forward (FULL_SHARD);
            False keeps them until backward (SHARD_GRAD_OP).
        mesh: the data-parallel device mesh; ``None`` means all ranks.

    Returns:
        The plan that was applied.

    Raises:
        ValueError: if a policy selects nothing.
    """
    plan = plan_shard(model, policy)
    kwargs: Dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        kwargs["mesh"] = mesh
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    candidates = _candidates(model)
    for name in plan.units:
        fully_shard(candidates[name][0], **kwargs)
    fully_shard(model, **kwargs)
    return plan
