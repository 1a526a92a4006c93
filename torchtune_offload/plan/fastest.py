"""Which planned variant is fastest among those that fit both budgets: the planner's answer to
"which setting should I run on my machine", with and without a change to the optimizer's math."""

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

from omegaconf import OmegaConf

from torchtune_offload.plan.planner import GIB, VariantPlan
from torchtune_offload.plan.speed import Speed
from torchtune_offload.recipe.chosen_optimizer import describe_optimizer


#: Keys of the config a variant may set otherwise than the config as given (the one stepping in
#: backward runs without clipping or accumulation), which changes what its steps compute.
_TRAINING_KEYS = ("clip_grad_norm", "gradient_accumulation_steps")


def math_change(variant: Mapping[str, Any], *, config: Mapping[str, Any]) -> Optional[str]:
    """How a variant's steps differ by design from full-precision AdamW's on the config as given.

    Args:
        variant: the config the variant runs (``planner.variant_config``), as a mapping.
        config: the config as given, as a mapping.

    Returns:
        What differs, joined by "and": ``8-bit optimizer states``, ``FP8 layer weights``, and any of
        clipping or accumulation set otherwise than in the config (as ``clip_grad_norm=None
        instead of 1.0``); None where nothing does. fp32 master weights and bitsandbytes' 32-bit
        states are not counted: they are not less precise than plain AdamW's bf16 states.
    """
    changes = []
    try:
        chosen = describe_optimizer(OmegaConf.create(variant.get("optimizer") or {}),
                                    in_backward=variant.get("optimizer_in_bwd") is True)
    except ValueError:  # a variant the recipe refuses is planned as such, never the fastest
        chosen = None
    if chosen is not None and "8bit" in f"{chosen.optimizer_class.__name__} {chosen.base_class.__name__}".lower():
        changes.append("8-bit optimizer states")
    if chosen is not None and chosen.device_weights == "fp8":
        changes.append("FP8 layer weights")
    changes += [f"{key}={variant.get(key)} instead of {config.get(key)}" for key in _TRAINING_KEYS
                if variant.get(key) != config.get(key)]
    return " and ".join(changes) or None


@dataclass(frozen=True)
class Fastest:
    """The fastest variants that fit, by expected tok/s (see :func:`fastest_fitting`).

    Attributes:
        overall: the fastest of all that fit; None where none fits.
        exact: the fastest without a :func:`math_change`; None where none fits.
    """

    overall: Optional[str]
    exact: Optional[str]


def expected_tokens_per_second(speed: Speed) -> float:
    """The predicted tok/s, times the middle of its kind's known gap where it has one (the lowest
    middle where several): a prediction the recorded runs of its kind fell short of ranks by what
    they made of it, not by the model's figure alone."""
    middles = [(lo + hi) / 2 for _, lo, hi in speed.known_gaps]
    return speed.tokens_per_second * min(middles, default=1.0)


def fastest_fitting(plans: List[VariantPlan], speeds: Mapping[str, Optional[Speed]], *,
                    device_budget: Optional[int], host_budget: int,
                    math_changes: Mapping[str, Optional[str]]) -> Fastest:
    """The fastest variants that fit both budgets, by :func:`expected_tokens_per_second`.

    Args:
        plans: the planned variants.
        speeds: each variant's predicted step, by name (None where it has none).
        device_budget: device bytes (None: unknown, so nothing is known to fit).
        host_budget: host bytes.
        math_changes: each variant's :func:`math_change`, by name.

    Returns:
        The fastest overall and the fastest without a change to the optimizer's math.
    """
    ranked = sorted((p.name for p in plans
                     if p.fits(device_budget=device_budget, host_budget=host_budget) and speeds.get(p.name)),
                    key=lambda name: expected_tokens_per_second(speeds[name]), reverse=True)
    return Fastest(overall=next(iter(ranked), None),
                   exact=next((name for name in ranked if not math_changes.get(name)), None))


def fastest_block(plans: List[VariantPlan], speeds: Mapping[str, Optional[Speed]], *,
                  device_budget: Optional[int], host_budget: int,
                  math_changes: Mapping[str, Optional[str]], ranks: Optional[int] = None) -> List[str]:
    """Lines for under the planner's table: the fastest variant that fits, and the fastest with
    the optimizer's math unchanged where that is another one.

    Args:
        plans, speeds, device_budget, host_budget, math_changes: as for :func:`fastest_fitting`.
        ranks: the distributed recipe's ranks: the speeds are one rank's without FSDP2's
            collectives, so the lines rank the variants by them and say so, giving no tok/s.
    """
    best = fastest_fitting(plans, speeds, device_budget=device_budget, host_budget=host_budget,
                           math_changes=math_changes)
    budgets = (f"device {'?' if device_budget is None else f'{device_budget / GIB:.1f}'} GiB, "
               f"host {host_budget / GIB:.1f} GiB")
    if best.overall is None:
        return ["", f"No planned variant fits both budgets ({budgets})."]

    def line(name: str) -> str:
        s = speeds[name]
        text = f"{name}: {s.tokens_per_second:.0f} tok/s predicted, {s.step_seconds:.3g} s a step"
        if ranks is not None:
            text = f"{name}: {s.step_seconds:.3g} s a step on each rank, FSDP2's collectives not counted"
        if s.known_gaps:
            expected = expected_tokens_per_second(s)
            text += f" (about {expected:.0f} by what recorded runs of its kind made of such predictions)"
        change = math_changes.get(name)
        return text + (f"; its steps differ from AdamW's full-precision steps on the config: {change}"
                       if change else "")

    basis = ("by predicted tok/s, times the middle of its kind's known gap where it has one" if ranks is None else
             f"each of {ranks} devices and the machine's host; ranked by one rank's step without FSDP2's all-gathers "
             "and reduce-scatters, the same in every fsdp2_ variant but fsdp2_cpu_offload, whose copies of the shards "
             "in each pass are not counted either: the order of the variants that fit, not their speed")
    lines = ["", f"Fastest that fits both budgets ({budgets}), {basis}:", f"- {line(best.overall)}"]
    if best.exact != best.overall:
        lines.append("- with AdamW's full-precision steps on the config's clipping and accumulation: "
                     + (line(best.exact) if best.exact else "none fits"))
    return lines
