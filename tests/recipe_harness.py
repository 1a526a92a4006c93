"""Running the project's recipes in-process on the tiny assets: shared by the recipe tests."""

import functools
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
#: torchtune's ``tune`` command, run by this interpreter: a ``tune`` found on PATH may belong to
#: another Python, or be missing where the project's virtual environment is not activated.
TUNE = [sys.executable, "-m", "torchtune._cli.tune"]


@functools.lru_cache(maxsize=None)
def load_recipe_module(name: str) -> ModuleType:
    """``recipes/<name>.py`` as a module (torchtune's installed ``recipes`` package shadows ours)."""
    spec = importlib.util.spec_from_file_location(f"_test_recipe_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def tiny_asset_overrides(assets: Path) -> List[str]:
    """Points a configs/tiny config at the test run's assets (conftest's ``tiny_assets``)."""
    return [
        f"checkpointer.checkpoint_dir={assets / 'model'}",
        f"tokenizer.path={assets / 'tokenizer' / 'tokenizer.model'}",
        f"tokenizer.special_tokens_path={assets / 'tokenizer' / 'special_tokens.json'}",
        f"dataset.data_files={assets / 'data' / 'train.json'}",
    ]


def path_without(*commands: str) -> str:
    """``PATH`` less every folder that holds one of ``commands``: a child given it runs them only
    through this interpreter, as it must where the project's virtual environment is not activated."""
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(f for f in folders if f and not any(os.path.isfile(os.path.join(f, c)) for c in commands))


def working_tree_env(**extra: str) -> Dict[str, str]:
    """This process's environment for a child that must import the working tree's package first.

    The working tree goes in front of ``PYTHONPATH``; entries already there stay (a machine may
    keep the dependencies on it, as the GPU machine's wheel folder does).
    """
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
