"""The config rules about the optimizer: its component, its options (every key against its
signature, every value by building it on a probe parameter) and what the run asks of it that its
declared capabilities rule out. Once they pass, ``recipe/chosen_optimizer.py`` describes the
optimizer; these rules and that description are the only readers of ``cfg.optimizer``'s keys."""

import difflib
import inspect
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torchao.optim
from omegaconf import DictConfig, OmegaConf

from torchtune_offload.optim.base_options import base_option_problems
from torchtune_offload.optim.capabilities import OptimizerCapabilities, capabilities_of
from torchtune_offload.optim.optimizer_class import (
    DEFAULT_BASE,
    resolve_optimizer,
    resolve_optimizer_class,
    split_options,
)
from torchtune_offload.recipe.checks.config_keys import top_level_hint


def is_int(v: Any, *, low: int) -> bool:
    """An integer (not a bool) of at least ``low``: how every count in a config is checked."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def resolve_optimizer_component(cfg_optimizer: Any) -> Tuple[type, OptimizerCapabilities]:
    """The class ``cfg.optimizer._component_`` names, and what it can do.

    Raises:
        ValueError: if ``optimizer._component_`` is missing, does not resolve, or names torchao's
            own class (whose ``optimizer_class`` a config cannot hold).
    """
    path = cfg_optimizer.get("_component_") if isinstance(cfg_optimizer, DictConfig) else None
    if not path:
        raise ValueError("optimizer._component_ is missing. Set it, e.g. optimizer._component_=torch.optim.AdamW.")
    component = resolve_optimizer(path, key="optimizer._component_")
    capabilities = capabilities_of(component)
    if not capabilities.offloads and issubclass(component, torchao.optim.CPUOffloadOptimizer):
        raise ValueError(
            f"optimizer._component_={path}: torchao's class takes optimizer_class as a class, which a "
            "config cannot hold. Use optimizer._component_=torchtune_offload.CPUOffloadOptimizer."
        )
    return component, capabilities


def component_capabilities(cfg_optimizer: Any) -> Optional[OptimizerCapabilities]:
    """What ``optimizer._component_``'s class can do, or None where it does not resolve."""
    try:
        return resolve_optimizer_component(cfg_optimizer)[1]
    except ValueError:
        return None


def configured_device_weights(cfg_optimizer: Any) -> Optional[str]:
    """``optimizer.device_weights`` as the config gives it (None where absent), for the rules that
    name it when the optimizer could not be described."""
    return cfg_optimizer.get("device_weights") if isinstance(cfg_optimizer, DictConfig) else None


def configured_base_class(cfg_optimizer: DictConfig) -> type:
    """The base optimizer an offloading ``optimizer._component_`` steps with: its
    ``optimizer_class``, else AdamW (both offloaders' default).

    Raises:
        ValueError: if ``optimizer.optimizer_class`` does not resolve to an optimizer.
    """
    return base_class_of(config_options(cfg_optimizer))


def base_class_of(options: Mapping[str, Any]) -> type:
    """The base optimizer of an offloader's keyword ``options``: their ``optimizer_class``, else AdamW.

    Raises:
        ValueError: if ``optimizer_class`` does not resolve to an optimizer.
    """
    return resolve_optimizer_class(options.get("optimizer_class", DEFAULT_BASE))


def config_options(cfg_optimizer: DictConfig) -> Dict[str, Any]:
    """The keyword options ``cfg.optimizer`` gives its component (every key but ``_component_``)."""
    return {k: v for k, v in OmegaConf.to_container(cfg_optimizer, resolve=True).items() if k != "_component_"}


def _keyword_names(cls: type, *, kwargs_go_elsewhere: bool = False) -> Optional[set]:
    """The keyword options ``cls(params, ...)`` takes, or None if it takes any (``**kwargs``).

    Args:
        kwargs_go_elsewhere: ``**kwargs`` are forwarded to another class (an offloader's base
            optimizer), whose own names are checked separately.
    """
    names = set()
    for name, param in list(inspect.signature(cls.__init__).parameters.items())[2:]:  # self, params
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            if kwargs_go_elsewhere:
                continue
            return None
        if param.kind is not inspect.Parameter.VAR_POSITIONAL:
            names.add(name)
    return names


def optimizer_option_problems(
    cfg_optimizer: DictConfig, component: type, caps: OptimizerCapabilities, *, reported: set
) -> List[str]:
    """Unknown ``optimizer:`` keys (with the closest valid name) and values the optimizer refuses.

    The optimizer is built on a one-element CPU parameter, so its own checks run before any weight
    is read; only the base optimizer is built for an offloader that needs an accelerator (torchao's).
    """
    options = config_options(cfg_optimizer)
    base = None
    if caps.offloads:
        try:
            base = configured_base_class(cfg_optimizer)
        except ValueError:
            return []  # reported by the optimizer_class check
    own = _keyword_names(component, kwargs_go_elsewhere=base is not None)
    theirs = _keyword_names(base) if base is not None else set()
    problems = []
    if own is not None and theirs is not None:
        valid = own | theirs
        for key in sorted(set(options) - valid - {k.split(".", 1)[1] for k in reported}):
            close = difflib.get_close_matches(key, [*sorted(valid), "_component_"], n=1)
            hint = top_level_hint("optimizer", key) or (
                f"Did you mean '{close[0]}'?" if close else f"Valid options: {', '.join(sorted(valid))}.")
            name = component.__name__ + (f" (base {base.__name__})" if base is not None else "")
            problems.append(f"optimizer.{key}: not an option of {name}. {hint}")
    if problems or reported:
        return problems
    if base is not None:
        # The base optimizer's options first: each refused value is named with its accepted form.
        name = f"{component.__name__} (base {base.__name__})"
        problems = base_option_problems(base, {k: v for k, v in options.items() if k not in (own or ())},
                                        owner=name)
        if problems or caps.device_types is not None:
            # An offloader that needs an accelerator (torchao's) is not built on this probe; its own
            # options are checked by its own check, where it has one.
            check_own = getattr(component, "check_own_options", None)
            if not problems and check_own is not None:
                try:
                    check_own(split_options(component.__init__, options)[0])
                except ValueError as err:
                    problems.append(str(err))
            return problems
    else:
        return base_option_problems(component, options, named=caps.named_parameters)
    param = torch.nn.Parameter(torch.zeros(1))
    try:
        component([("probe", param)] if caps.named_parameters else [param], **options)
    except Exception as err:  # as base_options' probe: whatever it raises refuses the options
        # The engine's own options name their key (optimizer.<key>) in its message.
        problems.append(f"optimizer: {component.__name__} refuses its options: {err}")
    return problems


def capability_problems(
    cfg: DictConfig,
    caps: OptimizerCapabilities,
    *,
    in_bwd: bool,
    clip: Optional[float],
    accum: Any,
    offload_gradients: bool,
    device_type: str,
) -> List[str]:
    """What the run asks of the optimizer that its declared capabilities rule out."""
    component = cfg.optimizer._component_
    problems = []
    if in_bwd and not caps.steps_in_backward:
        problems.append(
            f"optimizer_in_bwd=True with optimizer._component_={component}: "
            f"{caps.why_not('steps_in_backward')}. Set optimizer_in_bwd=False."
        )
    if clip is not None and not caps.can_clip:
        problems.append(
            f"clip_grad_norm is set but optimizer._component_={component} cannot clip: "
            f"{caps.why_not('can_clip')}. Set clip_grad_norm=null, or "
            "optimizer._component_=torchtune_offload.OffloadOptimizer."
        )
    if offload_gradients and is_int(accum, low=2) and not caps.accumulates_offloaded_grads:
        problems.append(
            f"gradient_accumulation_steps > 1 with {component} and optimizer.offload_gradients=True: "
            f"{caps.why_not('accumulates_offloaded_grads')}. Set gradient_accumulation_steps=1, "
            "optimizer.offload_gradients=False, or optimizer._component_=torchtune_offload.OffloadOptimizer."
        )
    for key in ("master_dtype", "grad_sum_dtype"):
        value = cfg.optimizer.get(key)
        if value is None:
            continue
        # Values are checked where the optimizer is built on a probe (_optimizer_option_problems).
        if not caps.precision_policy:
            problems.append(f"optimizer.{key}={value} with {component}: {caps.why_not('precision_policy')}. "
                            f"Remove it (~optimizer.{key}).")
    if caps.device_types is not None and device_type not in caps.device_types:
        problems.append(
            f"device={cfg.device} with {component}: {caps.why_not('device_types')}. Use "
            "optimizer._component_=torchtune_offload.OffloadOptimizer, which runs on any device."
        )
    return problems


def add_optimizer_problems(cfg: DictConfig, problems: List[str], *, in_bwd: bool, clip: Optional[float],
                           accum: Any) -> None:
    """Adds to ``problems`` every rule about the optimizer the config breaks: its component, its base
    optimizer, what the run asks of it that its capabilities rule out, and its options' keys and values."""
    optimizer_class, caps = None, None
    offload_gradients = False
    try:
        optimizer_class, caps = resolve_optimizer_component(cfg.optimizer)
    except ValueError as err:
        problems.append(str(err))
    if caps is not None and caps.offloads:
        offload_gradients = cfg.optimizer.get("offload_gradients", False)
        if not isinstance(offload_gradients, bool):
            problems.append(f"optimizer.offload_gradients={offload_gradients!r}: must be True or False.")
        try:
            configured_base_class(cfg.optimizer)
        except ValueError as err:
            problems.append(str(err))
    if caps is not None:
        problems.extend(capability_problems(
            cfg, caps, in_bwd=in_bwd, clip=clip, accum=accum,
            offload_gradients=offload_gradients is True, device_type=str(cfg.device).split(":")[0],
        ))
    if caps is not None and optimizer_class is not None:
        # One problem per key: keys the rules above reported are not listed again, and the probe,
        # which would repeat those rules, is built only when they all passed.
        reported = {p.split("=")[0].split(":")[0] for p in problems if p.startswith("optimizer.")}
        problems.extend(optimizer_option_problems(cfg.optimizer, optimizer_class, caps, reported=reported))
    if in_bwd:
        if clip is not None:
            problems.append("optimizer_in_bwd=True with clip_grad_norm set: clipping needs all gradients "
                            "before any step. Set clip_grad_norm=null or optimizer_in_bwd=False.")
        if is_int(accum, low=2):
            problems.append("optimizer_in_bwd=True with gradient_accumulation_steps > 1: each backward "
                            "steps at once. Set gradient_accumulation_steps=1 or optimizer_in_bwd=False.")
