"""Lets ``tune run recipes/<file>.py`` find this project's recipes.

torchtune ships a top-level ``recipes`` package that refuses to be imported, and ``tune run``
imports a custom recipe path as the module ``recipes.<file>`` with the working directory appended
*after* site-packages, so torchtune's package always wins. This finder, installed at interpreter
start by ``torchtune_offload_recipes.pth``, resolves ``recipes`` to the working directory's
``recipes/`` instead, but only when that directory is torchtune-offload's (its ``__init__.py``
carries the marker below). It imports nothing heavy: it runs in every Python process.
"""

import importlib.abc
import importlib.machinery
import os
import sys

MARKER = "TORCHTUNE_OFFLOAD_RECIPES"


class _RecipesFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "recipes" and not fullname.startswith("recipes."):
            return None
        root = os.getcwd()
        init = os.path.join(root, "recipes", "__init__.py")
        try:
            with open(init, encoding="utf-8") as f:
                if MARKER not in f.read():
                    return None
        except OSError:
            return None
        search = [root] if fullname == "recipes" else [os.path.join(root, "recipes")]
        return importlib.machinery.PathFinder.find_spec(fullname, search)


def install() -> None:
    if not any(isinstance(f, _RecipesFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RecipesFinder())
