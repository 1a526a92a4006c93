"""The recipes and configs that ship with the package, found by name as ``tune ls`` lists them.

They live at the repository's ``recipes/`` and ``configs/`` (other tools and tests use those paths).
A regular install (``pip install .``) copies both into the package as ``torchtune_offload/_shipped``
(setup.py's build step); an editable install or a working tree reads them where they are, one folder
above the package. Every ``*.yaml`` below ``configs/`` is a config, named by its path there without
the suffix (``tiny/full``), so a config added later is listed without editing anything here. A
config belongs to the first of our recipes its leading comment names (each config's header gives
its launch command).
"""

import dataclasses
import difflib
import re
from pathlib import Path
from typing import Dict, List, Optional

import torchtune
from torchtune._recipe_registry import get_all_recipes

#: What ``recipes/__init__.py`` carries, to tell our folder from torchtune's ``recipes`` package.
RECIPES_MARKER = "TORCHTUNE_OFFLOAD_RECIPES"
#: The folder a regular install copies ``recipes/`` and ``configs/`` into, inside the package.
SHIPPED_DIR = "_shipped"
#: The setting ``check_recipe_config(recipe=...)`` takes for each recipe: ``tune-offload validate``
#: checks a config as the recipe it names would. A recipe missing here is refused by a test.
RECIPE_KINDS = {
    "full_finetune_single_device": "full",
    "lora_finetune_single_device": "lora",
    "full_finetune_distributed": "distributed",
}
PACKAGE_DIR = Path(__file__).resolve().parents[1]
#: Where torchtune's install keeps the configs ``tune ls`` lists (``tune run`` reads them there too).
TORCHTUNE_CONFIGS = Path(torchtune.__file__).resolve().parents[1] / "recipes" / "configs"


def torchtune_config(name: str) -> Optional[Path]:
    """The file of torchtune 0.6.1's own config ``name`` (``tune ls`` lists them), or None.

    Our recipes take torchtune's configs (with their recipes' names), so they are found by name too,
    after this package's own (no name is in both).
    """
    for recipe in get_all_recipes():
        for config in recipe.configs:
            if config.name == name and (TORCHTUNE_CONFIGS / config.file_path).is_file():
                return TORCHTUNE_CONFIGS / config.file_path
    return None


def _is_our_recipes(folder: Path) -> bool:
    try:
        return RECIPES_MARKER in (folder / "__init__.py").read_text(encoding="utf-8")
    except OSError:
        return False


def shipped_root(*, package_dir: Path = PACKAGE_DIR) -> Path:
    """The folder holding ``recipes/`` and ``configs/``: the installed copy, else the clone's.

    Args:
        package_dir: the ``torchtune_offload`` package folder.

    Raises:
        FileNotFoundError: neither an installed copy nor a clone's folders are there.
    """
    for root in (package_dir / SHIPPED_DIR, package_dir.parent):
        if _is_our_recipes(root / "recipes") and (root / "configs").is_dir():
            return root
    raise FileNotFoundError(
        f"torchtune-offload's recipes and configs are in neither {package_dir / SHIPPED_DIR} (a regular "
        f"install) nor {package_dir.parent} (a clone). Reinstall the package: pip install <clone>."
    )


def header_recipe(path: Path, recipes: List[str]) -> Optional[str]:
    """The first of ``recipes`` named in the comment lines that open the YAML file at ``path``."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(recipes, key=len, reverse=True))) + r")\b")
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip() and not line.lstrip().startswith("#"):
                break
            found = pattern.search(line)
            if found:
                return found.group(1)
    return None


@dataclasses.dataclass(frozen=True)
class Shipped:
    """The recipes and configs below one root (see :func:`shipped_root`).

    Attributes:
        root: the folder holding ``recipes/`` and ``configs/``.
    """

    root: Path

    @property
    def recipes(self) -> Dict[str, Path]:
        """Recipe name (file stem) -> file, sorted by name."""
        files = sorted((self.root / "recipes").glob("*.py"))
        return {f.stem: f for f in files if not f.stem.startswith("_")}

    @property
    def configs(self) -> Dict[str, Path]:
        """Config name (path below ``configs/``, no suffix) -> file, sorted by name."""
        base = self.root / "configs"
        return {p.relative_to(base).with_suffix("").as_posix(): p for p in sorted(base.rglob("*.yaml"))}

    def configs_by_recipe(self) -> Dict[Optional[str], List[str]]:
        """Recipe name -> the names of its configs; None -> configs whose header names no recipe."""
        out: Dict[Optional[str], List[str]] = {name: [] for name in self.recipes}
        for name, path in self.configs.items():
            out.setdefault(self.recipe_of(path), []).append(name)
        return out

    def recipe_of(self, config: Path) -> Optional[str]:
        """The recipe the header of the config file ``config`` names, or None."""
        return header_recipe(config, list(self.recipes))

    def recipe(self, name: str) -> Path:
        """The recipe file for a recipe name, or a path to a recipe file.

        Raises:
            ValueError: naming what was looked for and the recipes there are.
        """
        if name in self.recipes:
            return self.recipes[name]
        if name.endswith(".py") and Path(name).is_file():
            return Path(name).resolve()
        near = difflib.get_close_matches(name[:-3] if name.endswith(".py") else name, list(self.recipes), n=1)
        raise ValueError(
            f"no recipe named '{name}': looked for {self.root / 'recipes' / (name + '.py')}"
            + (" and for a file of that name" if name.endswith(".py") else "")
            + (f". Did you mean {near[0]}?" if near else "")
            + f" Recipes: {', '.join(self.recipes)} (tune-offload ls lists them with their configs)."
        )

    def config(self, name: str) -> Path:
        """The config file for a config name (``tiny/full``, or one of torchtune's own), or a path to a
        YAML file.

        Raises:
            ValueError: naming what was looked for and the configs there are.
        """
        if name in self.configs:
            return self.configs[name]
        if Path(name).is_file():
            return Path(name).resolve()
        theirs = torchtune_config(name)
        if theirs is not None:
            return theirs
        if Path(name).is_dir():
            raise ValueError(f"{name}: is a folder; name a config (tune-offload ls lists them) or a YAML file.")
        return self._unknown_config(name)

    def _unknown_config(self, name: str) -> Path:
        names = list(self.configs)
        stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
        stem = stem[len("configs/"):] if stem.startswith("configs/") else stem  # a clone's path, run elsewhere
        # The same file name in another folder, else the closest spellings (llama3_1/8B_ful_offload_engine).
        theirs = [c.name for recipe in get_all_recipes() for c in recipe.configs]
        near = ([n for n in names if n == stem or n.split("/")[-1] == stem.split("/")[-1]]
                or difflib.get_close_matches(stem, names + theirs, n=3, cutoff=0.8))
        hint = f" Did you mean {' or '.join(near)}?" if near else ""
        raise ValueError(
            f"no config named '{name}' and no file {Path(name).resolve()}: looked for "
            f"{self.root / 'configs' / (stem + '.yaml')}, torchtune's configs (tune ls lists them) and the file.{hint} "
            f"Configs: {', '.join(names)}."
        )
