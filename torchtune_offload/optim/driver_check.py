"""The engine options that only this project's recipes drive, refused under torchtune's own recipes.

torchtune's recipes (``tune run full_finetune_single_device``, or torchrun of its file) accept any
optimizer component, so a config with ``_component_: torchtune_offload.OffloadOptimizer`` runs under
them. With the optimizer alone that is exact: they read the device gradients, as plain AdamW's. But
they scale the gradients by ``1 / num_tokens`` and clip them on the model after backward, and with
``offload_gradients`` those gradients have already left for the host, so both calls would find
nothing and the run would train on unscaled, unclipped gradients without a word. ``overlap`` needs
the recipe to announce each window's last backward and ``device_weights`` to bind the model; they
do neither. This project's recipes do all three, so these options are refused where torchtune's
recipe is the program running, before any host buffer is made.
"""

import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torchtune
from torchtune._recipe_registry import get_all_recipes

#: Why each option needs this project's recipes (its keys: the options refused).
_NEEDS = {
    "offload_gradients": "it scales (1/num_tokens) and clips the gradients on the model after backward, where "
                         "offload_gradients has already moved them to the host: it would train on unscaled, "
                         "unclipped gradients",
    "overlap": "it never announces a window's last backward, so overlap would step serially",
    "device_weights": "it never binds the model, so the forward would not read FP8 weights",
}
#: The options only this project's recipes drive.
RECIPE_DRIVEN = tuple(_NEEDS)


def torchtune_recipe_running() -> Optional[str]:
    """The name of torchtune's own recipe if it is the program running (as ``__main__``), else None."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main_file:
        return None
    path = Path(main_file).resolve()
    # Where torchtune keeps its recipes and `tune run` runs them from.
    root = Path(torchtune.__file__).resolve().parent.parent / "recipes"
    return next((r.name for r in get_all_recipes() if (root / r.file_path).resolve() == path), None)


def check_recipe_drives(options: Dict[str, Any], *, owner: str) -> None:
    """Refuses the set options among ``options`` (``offload_gradients``, ``overlap``, ``device_weights``)
    where torchtune's own recipe runs the optimizer.

    Args:
        options: the option values as given, under their config keys.
        owner: the optimizer's name, for the message.

    Raises:
        ValueError: naming each such option set, why, and the recipe to run instead.
    """
    given = {key: value for key, value in options.items() if value not in (None, False)}
    recipe = torchtune_recipe_running() if given else None
    if recipe is None:
        return
    reasons = "; ".join(f"optimizer.{key}={value}: {_NEEDS[key]}" for key, value in given.items())
    raise ValueError(
        f"{owner} under torchtune's own recipe {recipe}: {reasons}. Run this project's recipe of the same name "
        f"instead, which takes the same config: `tune-offload run {recipe} --config <config>` (`tune-offload ls` "
        "lists them), or leave those options unset (the optimizer without them is exact under torchtune's recipe)."
    )
