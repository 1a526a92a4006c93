"""The options a config gives its components, checked against what each ``_component_`` takes.

torchtune builds a config's components (the learning-rate scheduler, the loss, the checkpointer,
the dataset, ...) when the recipe reaches them, and an option a component does not take fails
there with a ``TypeError``: for the scheduler, after the model's weights have loaded. torchtune's
own ``config.validate`` binds the options to each component's signature, but for a component that
also takes objects the recipe passes (a scheduler's optimizer, a dataset's tokenizer) its second
try raises that ``TypeError`` uncaught, and a component it cannot import is a traceback too. Here
every option of a top-level component is looked up in its signature before anything is built, and
a stranger is named with the closest option. A component that takes ``**kwargs`` (torchtune's
datasets forward theirs to ``load_dataset``) cannot be checked so, and is not. The recipes' check
(``recipe.config``) leaves out the model (the recipe and the planner report a builder they cannot
build, in one line) and the optimizer (checked by building it); ``tune-offload validate`` checks
the model here too.
"""

import difflib
import inspect
from typing import List, Sequence

from omegaconf import DictConfig
from torchtune.config._utils import _get_component_from_path

__all__ = ["component_option_problems"]

#: Components the recipes check elsewhere (see the module's docstring).
CHECKED_ELSEWHERE = ("model", "optimizer")
#: Keys of a component that this project's recipes read and remove before building it.
_RECIPE_KEYS = {"profiler": ("all_threads",)}


def component_option_problems(cfg: DictConfig, *, skip: Sequence[str] = CHECKED_ELSEWHERE) -> List[str]:
    """Every option of a top-level component that its ``_component_`` does not take, and every
    such component that cannot be imported.

    Args:
        cfg: a recipe config.
        skip: top-level keys not checked here.

    Returns:
        One line per problem, naming the key and the fix; empty when there is none.
    """
    problems = []
    for node, value in cfg.items():
        if node in skip or not isinstance(value, DictConfig) or not value.get("_component_"):
            continue
        path = str(value.get("_component_"))
        try:
            target = _get_component_from_path(path)
        except Exception as err:  # torchtune raises its own InstantiationError, or ValueError for a bad path
            reason = " ".join(str(err).split())
            problems.append(f"{node}._component_={path}: cannot be imported ({type(err).__name__}: {reason[:200]}). "
                            "Give the dotted path of an importable class or function.")
            continue
        try:
            parameters = inspect.signature(target).parameters
        except (TypeError, ValueError):  # a callable without a signature (a builtin): nothing to check against
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        names = sorted(n for n, p in parameters.items()
                       if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY))
        for key in value.keys():
            if key == "_component_" or key in names or key in _RECIPE_KEYS.get(node, ()):
                continue
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (f"Did you mean '{node}.{close[0]}'?" if close else
                    f"Remove it: drop a {node}.{key}=... override, or ~{node}.{key} deletes it from the YAML.")
            problems.append(f"{node}.{key}: not an option of {path}. {hint} Its options: {', '.join(names)}.")
    return problems
