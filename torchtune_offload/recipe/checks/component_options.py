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
(``recipe.config``) leaves out the optimizer (checked by building it) and the model, which
:func:`model_option_problems` checks more closely: a model builder checks none of its own options,
so ``model.lora_rank=abc`` failed inside the build with a ``TypeError`` that named no key, after the
checkpoint had been read, and ``model.lora_rank=0`` at the first step (a ``ZeroDivisionError``).
There each option is also checked against the builder's annotation, and a required argument must
be given. The types are checked for any builder; the ranges (an ``int`` is a size or a count, so at
least 1; a ``*_dropout`` is a probability below 1) only for torchtune's and this package's, where
they were checked against every builder's defaults: a user's builder may take a 0 or a -1.
"""

import difflib
import inspect
import types
import typing
from typing import Any, List, Mapping, Optional, Sequence

from omegaconf import DictConfig
from torchtune.config._utils import _get_component_from_path

from torchtune_offload.recipe.checks.config_keys import top_level_hint

__all__ = ["component_option_problems", "component_removal_problem", "model_option_problems", "nulled",
           "unchecked_options"]

#: The components a recipe runs without where the config nulls them (``lr_scheduler=null``): what then.
OPTIONAL_COMPONENTS = {"lr_scheduler": "schedule (the learning rate stays at optimizer.lr)", "profiler": "profiler"}
#: Components the recipes check elsewhere (see the module's docstring).
CHECKED_ELSEWHERE = ("model", "optimizer")
#: Model builders whose ints are all sizes or counts (at least 1) and whose dropouts are probabilities:
#: checked against every builder of torchtune 0.6.1 and of this package (no default below 1).
_RANGED_BUILDERS = ("torchtune.", "torchtune_offload.")
#: Options the recipes pass a component themselves (after the config's, which they would overwrite).
_RECIPE_PASSES = {
    "lr_scheduler": {"optimizer": "the optimizer", "num_training_steps": "the run's step count",
                     "last_epoch": "the step a resumed run starts from"},
    "checkpointer": {"should_load_recipe_state": "resume_from_checkpoint"},
}
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
            reason = reason if len(reason) <= 400 else reason[:reason.rfind(" ", 0, 400)] + " ..."  # a whole word
            problems.append(f"{node}._component_={path}: cannot be imported ({type(err).__name__}: {reason}). "
                            "Give the dotted path of an importable class or function.")
            continue
        parameters = _parameters(target)
        problems += _name_problems(node, value, parameters)
        problems += _value_problems(node, value, parameters, ranges=False)
    return problems


def nulled(node: DictConfig) -> bool:
    """A component whose ``_component_`` is given as null: what torchtune makes of ``lr_scheduler=null``
    on the command line (it sets a component's ``_component_``), and of ``_component_: null`` in a YAML."""
    return "_component_" in node and node.get("_component_") is None


def unchecked_options(cfg: DictConfig) -> List[str]:
    """The options of top-level components that take ``**kwargs`` which are none of their named
    parameters (a torchtune dataset's passed on to ``load_dataset``): what no signature can check.

    Args:
        cfg: a recipe config.

    Returns:
        ``node.key`` for each such option.
    """
    out = []
    for node, value in cfg.items():
        if node in CHECKED_ELSEWHERE or not isinstance(value, DictConfig) or not value.get("_component_"):
            continue
        try:
            parameters = inspect.signature(_get_component_from_path(str(value.get("_component_")))).parameters
        except Exception:  # not importable, or no signature: named by component_option_problems, or not checkable
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            out += [f"{node}.{key}" for key in value.keys() if key != "_component_" and key not in parameters]
    return out


def component_removal_problem(data: Mapping[str, Any], overrides: Sequence[str]) -> Optional[str]:
    """Why a ``~key`` override of a node that holds a ``_component_`` cannot work, or None.

    torchtune's merge refuses to delete a component (``~lr_scheduler``) and says the key was not
    found, though the YAML has it; this names what works instead.

    Args:
        data: the config's YAML, as a plain mapping.
        overrides: the command line's ``key=value`` and ``~key`` overrides.
    """
    for override in overrides:
        if not override.startswith("~"):
            continue
        path = override[1:].split("=")[0]
        node: Any = data
        for part in path.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if isinstance(node, Mapping) and "_component_" in node:
            if path in OPTIONAL_COMPONENTS:
                instead = (f"give {path}=null instead: the recipes read a null _component_ as no "
                           f"{OPTIONAL_COMPONENTS[path]}")
            else:
                instead = f"{path} cannot be left out; give another component with {path}._component_=..."
            return (f"{override}: torchtune cannot delete a component from the command line ({path} holds "
                    f"_component_: {node['_component_']}); {instead}, or copy the config (tune-offload cp) and edit it.")
    return None


def model_option_problems(cfg: DictConfig) -> List[str]:
    """A model builder that cannot be imported, and every ``model.*`` option it does not take, lacks,
    or cannot use.

    Args:
        cfg: a recipe config.

    Returns:
        One line per problem, naming the key and the fix; empty when there is none.
    """
    model = cfg.get("model")
    if not isinstance(model, DictConfig) or not model.get("_component_"):
        return []
    path = str(model.get("_component_"))
    try:
        parameters = _parameters(_get_component_from_path(path))
    except Exception:  # named as for any other component
        return component_option_problems(cfg, skip=[n for n in cfg if n != "model"])
    if parameters is None:
        return []
    problems = _name_problems("model", model, parameters)
    problems += [f"model.{name}: required by {path}; set it in the config or with model.{name}=... on the command line."
                 for name, p in parameters.items() if name not in model and p.default is inspect.Parameter.empty
                 and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    return problems + _value_problems("model", model, parameters, ranges=path.startswith(_RANGED_BUILDERS))


def _value_problems(node: str, value: DictConfig, parameters: Optional[Mapping[str, inspect.Parameter]], *,
                    ranges: bool) -> List[str]:
    """The options of component ``node`` whose values its parameters' annotations do not allow."""
    if parameters is None:
        return []
    path = str(value.get("_component_"))
    problems = []
    for key in value.keys():
        if key in parameters:
            need = _value_need(str(key), value.get(key), parameters[key].annotation, ranges=ranges)
            if need is not None:
                problems.append(f"{node}.{key}={value.get(key)!r}: must be {need} ({path} takes {key}).")
    return problems


def _parameters(target: Any) -> Optional[Mapping[str, inspect.Parameter]]:
    """The parameters of ``target``, or None where they cannot be known: no signature, or ``**kwargs``
    (a torchtune dataset builder forwards its to ``load_dataset``)."""
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a callable without a signature (a builtin): nothing to check against
        return None
    try:  # annotations as types, where a module defers them (from __future__ import annotations)
        parameters = inspect.signature(target, eval_str=True).parameters
    except Exception:  # a name the module imports only for type checkers: the annotations stay text
        pass
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return parameters


def _name_problems(node: str, value: DictConfig, parameters: Optional[Mapping[str, inspect.Parameter]]) -> List[str]:
    """The options of component ``node`` that are not among ``parameters``, each with the closest one."""
    if parameters is None:
        return []
    path = str(value.get("_component_"))
    passed = _RECIPE_PASSES.get(node, {})
    names = sorted(n for n, p in parameters.items() if n not in passed
                   and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY))
    problems = []
    for key in value.keys():
        if key in passed:
            problems.append(f"{node}.{key}: the recipe sets it ({passed[key]}), so a value here would be overwritten. "
                            f"Remove it: drop a {node}.{key}=... override, or ~{node}.{key} deletes it from the YAML.")
            continue
        if key == "_component_" or key in names or key in _RECIPE_KEYS.get(node, ()):
            continue
        close = difflib.get_close_matches(str(key), [*names, "_component_"], n=1)
        hint = (top_level_hint(node, str(key)) or (f"Did you mean '{node}.{close[0]}'?" if close else
                f"Remove it: drop a {node}.{key}=... override, or ~{node}.{key} deletes it from the YAML."))
        problems.append(f"{node}.{key}: not an option of {path}. {hint} Its options: {', '.join(names)}.")
    return problems


def _value_need(name: str, value: Any, annotation: Any, *, ranges: bool) -> Optional[str]:
    """What ``value`` must be for a parameter annotated ``annotation``, where it is not; else None.

    Only plain annotations are checked (``bool``, ``int``, ``float``, ``str``, each also
    ``Optional``); a list's items are left to the builder and to the LoRA recipe's own rules.

    Args:
        name: the parameter's name.
        value: the config's value for it.
        annotation: the parameter's annotation.
        ranges: also check the ranges of torchtune's builders (ints at least 1, dropouts below 1).
    """
    optional = ""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == len(typing.get_args(annotation)) or len(kinds) != 1:
            return None  # a union of two kinds: not checked
        if value is None:
            return None
        annotation, optional = kinds[0], "null or "
    if annotation is bool and not isinstance(value, bool):
        return f"{optional}True or False"
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{optional}an integer" + (" >= 1" if ranges else "")
        # No torchtune model builder takes an int for which 0 or less makes sense: each is a size or a count.
        if ranges and value < 1:
            return f"{optional}an integer >= 1"
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{optional}a number"
        if ranges and name.endswith("dropout") and not 0 <= value < 1:
            return f"{optional}a probability, at least 0 and below 1"
    if annotation is str and not isinstance(value, str):
        return f"{optional}text"
    return None
