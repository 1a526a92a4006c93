"""The run's optimizer as the config chooses it, described once.

``cfg.optimizer`` and the top-level ``optimizer_in_bwd`` choose one of six kinds of optimizer
(:class:`OptimizerKind`). :func:`describe_optimizer` reads them once, after the config check's rules
about the optimizer (``recipe/checks/optimizer_rules.py``) passed, into a :class:`ChosenOptimizer`: its
kind, the class the config names, what that class can do, the base optimizer that does the
arithmetic with its options, and the offloaders' own options typed as
:class:`~torchtune_offload.optim.offload_options.OffloadOptions`. The recipes' optimizer adapter,
the host pre-flight, the planner and the checkpoint check read its fields; no other module reads an
optimizer option from the config by its key.
"""

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

import torchao.optim
from omegaconf import DictConfig

from torchtune_offload.distributed.sharded_offload import SHARDED_STATE_FORMAT
from torchtune_offload.optim.capabilities import OptimizerCapabilities, capabilities_of
from torchtune_offload.optim.offload_checkpoint import STATE_DICT_FORMAT
from torchtune_offload.optim.offload_options import OffloadOptions
from torchtune_offload.optim.offload_optimizer import OffloadOptimizer
from torchtune_offload.optim.optimizer_class import split_options
from torchtune_offload.recipe.checks.optimizer_rules import base_class_of, config_options, resolve_optimizer_component



class OptimizerKind(enum.Enum):
    """The kinds of optimizer a run can choose; each has its own adapter in the recipes
    (``recipe/run_optimizer.py``), and those of different layouts (:meth:`of_state`) write
    checkpointed states that cannot stand in for one another."""

    OFFLOAD_ENGINE = "torchtune_offload.OffloadOptimizer"
    SHARDED_ENGINE = "torchtune_offload.OffloadOptimizer on FSDP2's shards (one state per rank)"
    TORCHAO_OFFLOAD = "torchao's CPUOffloadOptimizer (torchtune_offload.CPUOffloadOptimizer)"
    PLAIN = "a plain optimizer (torch.optim)"
    BITSANDBYTES = "a bitsandbytes optimizer"
    IN_BACKWARD = "per-parameter optimizers (optimizer_in_bwd=True)"

    @property
    def offloads(self) -> bool:
        """Steps on host copies of the parameters (either offloader)."""
        return self in (OptimizerKind.OFFLOAD_ENGINE, OptimizerKind.SHARDED_ENGINE, OptimizerKind.TORCHAO_OFFLOAD)

    @property
    def layout(self) -> "OptimizerKind":
        """The kind whose checkpoint layout this kind writes: bitsandbytes' optimizers write a plain
        optimizer's (``state`` and ``param_groups``)."""
        return OptimizerKind.PLAIN if self is OptimizerKind.BITSANDBYTES else self

    @classmethod
    def of_state(cls, state_dict: Any) -> Optional["OptimizerKind"]:
        """The layout of ``state_dict`` (a plain optimizer's for torch's and bitsandbytes' states
        alike); None if it is no optimizer state."""
        if not isinstance(state_dict, dict):
            return None
        if state_dict.get("format") == STATE_DICT_FORMAT:
            return cls.OFFLOAD_ENGINE
        if state_dict.get("format") == SHARDED_STATE_FORMAT:
            return cls.SHARDED_ENGINE
        if "offloaded" in state_dict:
            return cls.TORCHAO_OFFLOAD
        if {"state", "param_groups"} <= set(state_dict):
            return cls.PLAIN
        return cls.IN_BACKWARD


@dataclass(frozen=True)
class ChosenOptimizer:
    """The optimizer a run's config chooses.

    Attributes:
        kind: which of the six kinds it is.
        component: ``optimizer._component_`` as the config gives it.
        optimizer_class: the class it names (for ``optimizer_in_bwd``, the per-parameter optimizers' class).
        capabilities: what ``optimizer_class`` can do (``optim/capabilities.py``).
        base_class: the class that does the arithmetic: an offloader's ``optimizer_class``, else
            ``optimizer_class`` itself.
        base_options: ``base_class``'s keyword options (``lr``, ``betas``, ...).
        offload: an offloader's own options, typed (torchao's wrapper takes ``offload_gradients``
            and ``minimal_size``; the others stay at their defaults); None for the other kinds.
        options: every keyword option ``optimizer_class`` is built with, as the config gives them.
    """

    kind: OptimizerKind
    component: str
    optimizer_class: type
    capabilities: OptimizerCapabilities
    base_class: type
    base_options: Mapping[str, Any]
    offload: Optional[OffloadOptions] = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def offload_gradients(self) -> bool:
        """The offloader copies each gradient to the host during backward and frees the device's."""
        return self.offload is not None and self.offload.offload_gradients

    @property
    def device_weights(self) -> Optional[str]:
        """The engine's ``device_weights`` (FP8 layer weights on the device), or None."""
        return self.offload.device_weights if self.offload is not None else None

    @property
    def identity(self) -> Dict[str, Optional[str]]:
        """What a step checkpoint records of it: the class of ``optimizer._component_`` and, for an
        offloader, of its base optimizer, by dotted name (spellings of one class, such as
        ``torch.optim.AdamW`` and ``torch.optim.adamw.AdamW``, compare equal)."""
        def name(cls: type) -> str:
            return f"{cls.__module__}.{cls.__qualname__}"

        return {"component": name(self.optimizer_class),
                "optimizer_class": name(self.base_class) if self.kind.offloads else None}

    def with_options(self, **changes: Any) -> "ChosenOptimizer":
        """The same choice with some options changed (None removes one), described anew: what the
        host pre-flight sizes when it suggests another setting.

        Raises:
            ValueError: as :func:`describe_optimizer`, for a change the optimizer refuses.
        """
        options = {**self.options, **changes}
        options = {key: value for key, value in options.items() if value is not None}
        return _describe(self.component, self.optimizer_class, options,
                         in_backward=self.kind is OptimizerKind.IN_BACKWARD,
                         sharded=self.kind is OptimizerKind.SHARDED_ENGINE)


def identity_overrides(identity: Mapping[str, Any]) -> str:
    """A recorded :attr:`ChosenOptimizer.identity` as the command-line overrides that choose it."""
    base = identity.get("optimizer_class")
    return f"optimizer._component_={identity.get('component')}" + (f" optimizer.optimizer_class={base}"
                                                                    if base else "")


def describe_optimizer(cfg_optimizer: DictConfig, *, in_backward: bool, sharded: bool = False) -> ChosenOptimizer:
    """Describes the optimizer ``cfg.optimizer`` and ``optimizer_in_bwd`` choose.

    The config check (``recipe/checks/config.py``) calls it once its rules about the optimizer have
    passed; called on its own, it raises on the first thing it cannot describe.

    Args:
        cfg_optimizer: the config's ``optimizer`` section.
        in_backward: the top-level ``optimizer_in_bwd``.
        sharded: the recipe shards the model with FSDP2 (the engine then steps each rank's shards:
            ``distributed/sharded_offload.py``).

    Raises:
        ValueError: naming the ``optimizer.<key>`` that does not resolve or that the offloader refuses.
    """
    cls, _ = resolve_optimizer_component(cfg_optimizer)  # raises for a missing, unknown or torchao's own class
    return _describe(cfg_optimizer._component_, cls, config_options(cfg_optimizer), in_backward=in_backward,
                     sharded=sharded)


def _describe(component: str, cls: type, options: Dict[str, Any], *, in_backward: bool,
              sharded: bool = False) -> ChosenOptimizer:
    caps = capabilities_of(cls)
    if not caps.offloads:
        if in_backward:
            kind = OptimizerKind.IN_BACKWARD
        elif cls.__module__.startswith("bitsandbytes."):
            kind = OptimizerKind.BITSANDBYTES
        else:
            kind = OptimizerKind.PLAIN
        return ChosenOptimizer(kind=kind, component=component, optimizer_class=cls, capabilities=caps,
                               base_class=cls, base_options=dict(options), options=dict(options))
    # The two offloaders the recipes drive: this project's engine, and torchao's wrapper
    # (ao_offload.py), whose class subclasses torchao's own; each has its adapter.
    if issubclass(cls, OffloadOptimizer):
        kind = OptimizerKind.SHARDED_ENGINE if sharded else OptimizerKind.OFFLOAD_ENGINE
    elif issubclass(cls, torchao.optim.CPUOffloadOptimizer):
        kind = OptimizerKind.TORCHAO_OFFLOAD
    else:
        raise ValueError(f"optimizer._component_={component}: an offloading optimizer the recipes cannot drive. Use "
                         "torchtune_offload.OffloadOptimizer or torchtune_offload.CPUOffloadOptimizer.")
    base = base_class_of(options)
    own, base_options = split_options(cls.__init__, {k: v for k, v in options.items() if k != "optimizer_class"})
    return ChosenOptimizer(kind=kind, component=component, optimizer_class=cls, capabilities=caps, base_class=base,
                           base_options=base_options, offload=OffloadOptions.parse(**own), options=dict(options))
