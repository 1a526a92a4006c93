"""Full, LoRA and QLoRA: the three fine-tunes of one model, found from the configured builder.

torchtune names its model builders by one convention: ``<module>.<name>`` builds the model,
``<module>.lora_<name>`` the same model with LoRA adapters, and ``<module>.qlora_<name>`` is
``lora_<name>`` with ``quantize_base=True``: its frozen base linears hold torchao ``NF4Tensor`` weights.
From the configured ``model._component_`` the planner finds the other two, so that one plan says
which of the three fits. A LoRA model keeps the configured adapters; a full model given LoRA gets
the adapters of the shipped ``*_lora_offload`` configs (:data:`DEFAULT_ADAPTERS`).
"""

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

__all__ = ["DEFAULT_ADAPTERS", "FineTune", "configured_fine_tune", "fine_tunes", "unquantised_twin"]

#: The adapters of the shipped 8B ``*_lora_offload`` configs, for LoRA and QLoRA of a full model's config.
DEFAULT_ADAPTERS: Dict[str, Any] = {"lora_attn_modules": ["q_proj", "v_proj", "output_proj"],
                                    "apply_lora_to_mlp": True, "lora_rank": 8, "lora_alpha": 16,
                                    "lora_dropout": 0.0}
_ADAPTER_KEYS = {*DEFAULT_ADAPTERS, "apply_lora_to_output", "use_dora", "quantize_base"}
_RECIPE = {"full": "full", "LoRA": "lora", "QLoRA": "lora"}


@dataclass(frozen=True)
class FineTune:
    """One fine-tune of the configured model.

    Attributes:
        name: ``full``, ``LoRA`` or ``QLoRA``.
        recipe: the recipe that runs it (``full`` or ``lora``).
        model: its ``model`` config, ``None`` where no builder was found.
        problem: why there is none.
    """

    name: str
    recipe: str
    model: Optional[Dict[str, Any]]
    problem: Optional[str] = None


def configured_fine_tune(cfg_model: DictConfig) -> str:
    """Which of full, LoRA and QLoRA the configured model is, from its builder's name and keys."""
    name = str(cfg_model.get("_component_", "")).rpartition(".")[2]
    if name.startswith("qlora_") or cfg_model.get("quantize_base", False):
        return "QLoRA"
    if name.startswith("lora_") or "lora_attn_modules" in cfg_model:
        return "LoRA"
    return "full"


def fine_tunes(cfg_model: DictConfig) -> List[FineTune]:
    """The full, LoRA and QLoRA versions of the configured model, by torchtune's builder names.

    The configured one is returned as configured; the others keep the configured keys their
    builder accepts (a tiny model's shapes, the adapters).
    """
    component = str(cfg_model.get("_component_", ""))
    module_name, _, name = component.rpartition(".")
    base = name[len("qlora_"):] if name.startswith("qlora_") else name[len("lora_"):] if name.startswith("lora_") else name
    given = {k: v for k, v in OmegaConf.to_container(cfg_model, resolve=True).items() if k != "_component_"}
    shapes = {k: v for k, v in given.items() if k not in _ADAPTER_KEYS}
    adapters = {k: v for k, v in given.items() if k in _ADAPTER_KEYS and k != "quantize_base"}
    if "lora_attn_modules" not in adapters:
        adapters = {**DEFAULT_ADAPTERS, **adapters}
    configured = configured_fine_tune(cfg_model)
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as err:
        return [FineTune(n, _RECIPE[n], None, f"{module_name} cannot be imported ({err})")
                for n in _RECIPE if n != configured] + [FineTune(configured, _RECIPE[configured], given)]

    def found(builder_name: str, args: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        builder = getattr(module, builder_name, None)
        if not callable(builder):
            return None
        return {"_component_": f"{module_name}.{builder_name}", **_accepted(builder, args)}

    models = {"full": found(base, shapes), "LoRA": found(f"lora_{base}", {**shapes, **adapters})}
    qlora = found(f"qlora_{base}", {**shapes, **adapters})
    lora = getattr(module, f"lora_{base}", None)
    if qlora is None and models["LoRA"] is not None and "quantize_base" in _parameters(lora):
        qlora = {**models["LoRA"], "quantize_base": True}
    models["QLoRA"] = qlora
    out = []
    for fine_tune, model in models.items():
        if fine_tune == configured:
            out.append(FineTune(fine_tune, _RECIPE[fine_tune], {"_component_": component, **given}))
        elif model is None:
            wanted = {"full": base, "LoRA": f"lora_{base}", "QLoRA": f"qlora_{base} (or lora_{base} with quantize_base)"}
            out.append(FineTune(fine_tune, _RECIPE[fine_tune], None, f"no builder {module_name}.{wanted[fine_tune]}"))
        else:
            out.append(FineTune(fine_tune, _RECIPE[fine_tune], model))
    return out


def unquantised_twin(cfg_model: DictConfig) -> Optional[Dict[str, Any]]:
    """A QLoRA model's LoRA twin: the same shapes, dtypes and adapters, its base weights left in the
    run's dtype; ``None`` for a model that is not QLoRA or has no LoRA builder.

    The planner's counts that read only the shapes of the model (the host pre-flight, the
    optimizer state of the adapters) are the same on the twin, which is a plain model of plain
    tensors (torchao's quantisation, even on the meta device, made an 8B QLoRA model take seconds
    to build before :mod:`~torchtune_offload.recipe.checks.meta_nf4`; now about as long as its twin).
    """
    if configured_fine_tune(cfg_model) != "QLoRA":
        return None
    lora = next(f for f in fine_tunes(cfg_model) if f.name == "LoRA")
    return lora.model


def _parameters(builder: Optional[Callable]) -> Dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(builder).parameters) if builder is not None else {}
    except (TypeError, ValueError):  # a builtin or C function: no signature to read
        return {}


def _accepted(builder: Callable, args: Dict[str, Any]) -> Dict[str, Any]:
    """The ``args`` ``builder`` takes (all of them where it takes ``**kwargs``)."""
    params = _parameters(builder)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(args)
    return {k: v for k, v in args.items() if k in params}
