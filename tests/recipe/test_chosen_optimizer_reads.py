"""The chosen optimizer is described once: no module outside the description and its rules reads an
optimizer option from a config (or an options mapping) by its key, and the engine's option
``offload_gradients`` is named only where it is declared and acted on."""

import ast
import dataclasses
from pathlib import Path

from torchtune_offload.optim.offload_options import OffloadOptions

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "torchtune_offload"
#: Where option keys are read: the description, the config check's optimizer rules, the options'
#: own parser, and the engine's checkpoint record and its re-sharding (a saved state's keys, not a config's).
READERS = {"recipe/chosen_optimizer.py", "recipe/checks/optimizer_rules.py", "optim/offload_options.py",
           "optim/offload_checkpoint.py", "distributed/reshard.py"}
OPTION_KEYS = {f.name for f in dataclasses.fields(OffloadOptions)} | {"optimizer_class"}
#: Where ``offload_gradients`` may be named in optim/: declared (offload_options), taken (the two
#: offloaders), acted on (host_grads), sized (memory_plan), refused under torchtune's recipes (driver_check).
MAX_MODULES_NAMING_OFFLOAD_GRADIENTS = 6


def _sources():
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "recipes").glob("*.py")]:
        rel = str(path.relative_to(PACKAGE)) if PACKAGE in path.parents else str(path.relative_to(REPO))
        if "_shipped" not in path.parts:
            yield rel, path


def _key_reads(tree: ast.AST):
    """``x.get("<option>")``, ``x["<option>"]`` and ``OmegaConf.select(cfg, "optimizer.<key>")``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            key = node.args[0].value
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and key in OPTION_KEYS:
                yield node.lineno, key
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "select":
            for arg in node.args[1:2]:
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("optimizer."):
                    yield node.lineno, arg.value
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in OPTION_KEYS:
            yield node.lineno, node.slice.value


def test_no_module_reads_an_optimizer_option_by_its_key_outside_the_description():
    found = [f"{rel}:{line}: {key}" for rel, path in _sources() if rel not in READERS
             for line, key in _key_reads(ast.parse(path.read_text()))]
    assert not found, ("read the chosen optimizer's fields (recipe/chosen_optimizer.py: ChosenOptimizer) instead of "
                       f"the option keys: {found}")


def test_the_check_sees_each_kind_of_read():
    tree = ast.parse('own.get("update_on")\nown["minimal_size"]\nOmegaConf.select(cfg, "optimizer.lr")\n'
                     'x.get("lr")\nstate["step"]\n')
    assert [key for _, key in _key_reads(tree)] == ["update_on", "minimal_size", "optimizer.lr"]


def test_offload_gradients_is_named_where_it_is_declared_and_acted_on():
    naming = sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "optim").glob("*.py")
                    if "offload_gradients" in p.read_text())
    assert len(naming) <= MAX_MODULES_NAMING_OFFLOAD_GRADIENTS, naming
