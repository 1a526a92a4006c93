"""Option values a base optimizer refuses, reported with the key, the value and the accepted form.

torch's optimizers check their options with comparisons such as ``0.0 <= lr``, so ``lr="fast"``
fails with "'<=' not supported between instances of 'float' and 'str'", naming neither the option
nor what it takes. :func:`base_option_problems` builds the optimizer on a one-element probe
parameter; when the optimizer refuses, it finds which option it refused (the build succeeds once
that option is left at its default) and says what the option takes, read from the optimizer's own
signature (its default and annotation).

This module imports nothing from the package, so the engine (a lower floor) can use it too:
:func:`check_base_options` raises the ``ValueError`` a constructor should.
"""

import inspect
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch


def _signature_options(cls: type) -> Dict[str, inspect.Parameter]:
    """The keyword options of ``cls(params, ...)``, by name."""
    return {name: p for name, p in list(inspect.signature(cls.__init__).parameters.items())[2:]
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}


def accepted_form(param: inspect.Parameter) -> str:
    """What an option takes, in a config's words, from its default and annotation."""
    default, note = param.default, str(param.annotation)
    if isinstance(default, bool):
        return "True or False"
    if isinstance(default, int):
        return f"an integer such as {default}" if "float" not in note else f"a number such as {default}"
    if isinstance(default, float):
        return f"a number such as {default:g}"
    if isinstance(default, (tuple, list)) and default and all(isinstance(v, (int, float)) for v in default):
        return f"a list of {len(default)} numbers such as [{', '.join(f'{v:g}' for v in default)}]"
    if isinstance(default, str):
        return f"a string such as {default!r}"
    if default is None and "bool" in note:
        return "True, False or null"
    if default is None and "float" in note:
        return "a number or null"
    if default is None and "int" in note:
        return "an integer or null"
    if default is inspect.Parameter.empty and note != str(inspect.Parameter.empty):
        return f"a value of type {note}"
    return f"what {param.name}'s documentation describes"


def _build(cls: type, options: Mapping[str, Any], *, named: bool) -> Optional[Exception]:
    probe = torch.nn.Parameter(torch.zeros(1))
    try:
        cls([("probe", probe)] if named else [probe], **options)
    except Exception as err:  # whatever the class raises (betas=[0.9]: an IndexError) refuses the options
        return err
    return None


def base_option_problems(cls: type, options: Mapping[str, Any], *, named: bool = False,
                         owner: Optional[str] = None) -> List[str]:
    """Every option of ``options`` that ``cls`` refuses, each naming ``optimizer.<key>``, its value,
    the optimizer's own reason and the accepted form.

    Args:
        cls: the optimizer class (a base optimizer, or one that takes ``(name, tensor)`` pairs).
        options: its keyword options as the config or the caller gives them.
        named: ``cls`` takes ``(name, parameter)`` pairs.
        owner: how messages name the optimizer (default: its class name).

    Returns:
        One line per refused option; one line naming every option when the refusal cannot be
        pinned on one (a combination); empty when ``cls`` accepts them.
    """
    err = _build(cls, options, named=named)
    if err is None:
        return []
    name = owner or cls.__name__
    signature = _signature_options(cls)
    # An option refused on its own (the others at their defaults) is named with its own reason;
    # else one whose removal lets the build pass; else the combination is.
    alone = {k: _build(cls, {k: v}, named=named) for k, v in options.items()
             if k in signature and signature[k].default is not inspect.Parameter.empty}
    culprits = {k: e for k, e in alone.items() if e is not None}
    if not culprits:
        culprits = {k: err for k in alone if _build(cls, {o: v for o, v in options.items() if o != k},
                                                      named=named) is None}
    if not culprits:
        given = ", ".join(f"optimizer.{k}={v!r}" for k, v in options.items()) or "no options"
        return [f"optimizer: {name} refuses {given}: {err}. Check these values against {name}'s documentation."]
    problems = []
    for key, reason in culprits.items():
        param = signature[key]
        default = param.default
        shown = list(default) if isinstance(default, tuple) else default
        problems.append(f"optimizer.{key}={options[key]!r}: {name} refuses it ({reason}). "
                        f"Give {accepted_form(param)} (default {shown}), e.g. optimizer.{key}="
                        f"{str(shown).replace(' ', '') if shown is not None else 'null'}.")
    return problems


def check_base_options(cls: type, options: Mapping[str, Any], *, owner: Optional[str] = None) -> None:
    """Raises a ``ValueError`` naming each option ``cls`` refuses (see :func:`base_option_problems`),
    for a constructor that forwards ``options`` to ``cls``; builds only a one-element probe.

    Raises:
        ValueError: listing each refused ``optimizer.<key>``, its value and the accepted form.
    """
    problems = base_option_problems(cls, options, owner=owner)
    if problems:
        raise ValueError("\n".join(problems))


def check_group_options(cls: type, options: Mapping[str, Any], groups: Sequence[Optional[Mapping[str, Any]]], *,
                        owner: str, extra_options: Optional[Mapping[str, Any]] = None) -> None:
    """:func:`check_base_options` for each parameter group that sets options of its own, merged over
    the constructor's ``options`` (and again over ``extra_options`` too, where given: options a host
    step adds, such as ``fused``), before anything is built for the groups. A ``None`` in ``groups``
    stands for a group not to check (one with nothing to train), keeping the others' numbers.

    Raises:
        ValueError: naming the group, each refused key, its value and the accepted form.
    """
    if extra_options:
        check_base_options(cls, {**options, **extra_options}, owner=f"{owner} (base {cls.__name__}, host step)")
    for i, group in enumerate(groups):
        own = {k: v for k, v in (group or {}).items() if k != "params"}
        if own:
            check_base_options(cls, {**options, **own}, owner=f"{owner} param group {i} (base {cls.__name__})")
            if extra_options:
                check_base_options(cls, {**options, **extra_options, **own},
                                   owner=f"{owner} param group {i} (base {cls.__name__}, host step)")
