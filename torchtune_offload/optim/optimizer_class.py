"""Turning the ``optimizer_class`` option into a torch optimizer class.

torchtune configs can only carry strings, so ``optimizer.optimizer_class=torch.optim.AdamW`` arrives
as a dotted path. Both offload optimizers accept a class or such a path.
"""

import inspect
from typing import Any, Callable, Dict, Tuple, Union

import torch
import torchao.optim
from torchtune.config._utils import _get_component_from_path

from torchtune_offload.optim.capabilities import capabilities_of

OptimizerClassSpec = Union[str, type]
#: The base optimizer both offloaders step with when ``optimizer_class`` is not given.
DEFAULT_BASE = "torch.optim.AdamW"


def _torch_optimizer_hint(name: str, *, key: str) -> str:
    """For a bare class name (``adamw``, as ``optimizer=adamw`` on torchtune's command line sets
    ``optimizer._component_``), the torch.optim class of that name, whatever its case."""
    if "." in name:
        return ""
    found = [n for n in dir(torch.optim) if n.lower() == name.strip().lower() and isinstance(getattr(torch.optim, n), type)]
    if not found:
        return ""
    node = key.rsplit(".", 1)[0] if key.endswith("._component_") else None
    said = f" ({node}={name} on the command line sets {key})" if node else ""
    return f"Did you mean 'torch.optim.{found[0]}'{said}? "


def resolve_optimizer(optimizer_class: OptimizerClassSpec, *, key: str) -> type:
    """Returns the ``torch.optim.Optimizer`` subclass named by ``optimizer_class``.

    Args:
        optimizer_class: an optimizer class, or its dotted import path such as ``"torch.optim.AdamW"``.
        key: the config key the value came from, named in error messages.

    Raises:
        ValueError: if the path is empty or does not resolve, or does not name an optimizer class.
    """
    cls = optimizer_class
    if isinstance(optimizer_class, str):
        if not optimizer_class.strip():
            raise ValueError(f"{key} is empty. Set it to a dotted path such as 'torch.optim.AdamW'.")
        try:
            cls = _get_component_from_path(optimizer_class)
        except Exception as err:  # torchtune raises its own InstantiationError
            raise ValueError(
                f"{key}={optimizer_class!r} does not resolve to an importable object ({err}). "
                f"{_torch_optimizer_hint(optimizer_class, key=key)}Set it to a dotted path such as "
                "'torch.optim.AdamW', 'torch.optim.SGD' or 'bitsandbytes.optim.AdamW8bit'."
            ) from err
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(
            f"{key}={optimizer_class!r} is not a torch.optim.Optimizer subclass. "
            "Set it to an optimizer class such as 'torch.optim.AdamW'."
        )
    return cls


def resolve_optimizer_class(
    optimizer_class: OptimizerClassSpec, *, key: str = "optimizer.optimizer_class"
) -> type:
    """Returns the base optimizer class named by ``optimizer_class``.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass, or its dotted import path such as
            ``"torch.optim.AdamW"`` or ``"bitsandbytes.optim.AdamW8bit"``.
        key: the config key the value came from, named in error messages.

    Returns:
        The optimizer class.

    Raises:
        ValueError: if the path does not resolve, or does not name a ``torch.optim.Optimizer``
            subclass that can serve as a base optimizer.
    """
    cls = resolve_optimizer(optimizer_class, key=key)
    if capabilities_of(cls).offloads or issubclass(cls, torchao.optim.CPUOffloadOptimizer):
        raise ValueError(
            f"{key}={optimizer_class!r} is itself an offload optimizer; offload optimizers do not "
            "nest. Set it to the base optimizer, e.g. 'torch.optim.AdamW'."
        )
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        # The engine steps each parameter's base optimizer without a closure (LBFGS needs one).
        raise ValueError(f"{key}={optimizer_class!r}: its step() needs a closure that re-evaluates the loss, "
                         "which an offloaded step cannot call. Use an optimizer that steps without one, e.g. "
                         "'torch.optim.AdamW'.")
    return cls


def split_options(constructor: Callable[..., Any], options: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Splits an offload optimizer's options into its own and its base optimizer's.

    Args:
        constructor: the offload optimizer's ``__init__``; its keyword-only parameters are its own.
        options: keyword options as given to it.

    Returns:
        ``(own, base)``: every own option, its default where not given, and the rest.
    """
    own = {name: p.default for name, p in inspect.signature(constructor).parameters.items()
           if p.kind is p.KEYWORD_ONLY}
    base = {k: v for k, v in options.items() if k not in own}
    own.update({k: v for k, v in options.items() if k in own})
    return own, base
