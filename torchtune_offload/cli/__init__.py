"""The ``tune-offload`` command: ``ls``, ``cp``, ``cat``, ``validate``, ``run`` and ``download`` for
torchtune-offload's recipes and configs, from any working directory after ``pip install``.

- ``recipe.shipped`` (re-exported here): where the recipes and configs are (installed copy or clone) and
  their names; the planner finds configs by name through it too.
- ``main``: the verbs; ``run`` hands over to torchtune's ``tune run`` machinery (and torchrun).
"""

from torchtune_offload.cli.main import main
from torchtune_offload.recipe.shipped import RECIPE_KINDS, Shipped, shipped_root

__all__ = ["RECIPE_KINDS", "Shipped", "main", "shipped_root"]
