"""The package's import structure: no cycles, imports at module top, folders importing downwards.

Every module of ``torchtune_offload`` is parsed (not imported), so a function-level import counts
as much as a module-level one: hiding an import inside a function is how cycles hide.
"""

import ast
import graphlib
import pkgutil
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

import torchtune_offload

PACKAGE = "torchtune_offload"
ROOT = Path(torchtune_offload.__file__).parent
#: Imported inside a function only because they may be missing (optional dependencies).
OPTIONAL_DEPENDENCIES = {"pynvml", "matplotlib", "wandb"}
#: A folder may import only folders on a lower floor (and itself). The root ``__init__`` re-exports.
FLOORS = {"optim": 0, "models": 0, "data": 0, "distributed": 1, "assets": 1, "recipe": 2, "bench": 3, "plan": 4,
          "cli": 5}


def _modules() -> Dict[str, Path]:
    found = {PACKAGE: ROOT / "__init__.py"}
    for info in pkgutil.walk_packages([str(ROOT)], prefix=f"{PACKAGE}."):
        base = ROOT.joinpath(*info.name.split(".")[1:])
        found[info.name] = base / "__init__.py" if info.ispkg else base.with_suffix(".py")
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> List[Tuple[str, bool, int]]:
    """(imported module, inside a function or class, line) for every import statement."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nested_nodes: Set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nested_nodes.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        nested = id(node) in nested_nodes
        if isinstance(node, ast.Import):
            out.extend((alias.name, nested, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out.append((module, nested, node.lineno))
            # `from pkg import submodule` imports the submodule too.
            out.extend(
                (f"{module}.{alias.name}", nested, node.lineno)
                for alias in node.names
                if f"{module}.{alias.name}" in MODULES
            )
    return out


def _internal_graph() -> Dict[str, Set[str]]:
    return {
        name: {m for m, _, _ in _imports(name, path) if m in MODULES and m != name}
        for name, path in MODULES.items()
    }


def test_the_walk_sees_every_folder():
    folders = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    assert set(FLOORS) <= folders, f"package folders missing from the walk: {set(FLOORS) - folders}"


def test_no_import_cycles():
    try:
        graphlib.TopologicalSorter(_internal_graph()).prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import cycle among the package's modules: {' -> '.join(err.args[1])}")


def test_cycle_detection_sees_function_level_imports(tmp_path):
    """The check above would catch a cycle hidden in a function: shown on a two-module sample."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    graph = {
        "a": {m for m, _, _ in _imports("a", tmp_path / "a.py")},
        "b": {m for m, nested, _ in _imports("b", tmp_path / "b.py") if nested},
    }
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def test_imports_are_at_module_top_except_optional_dependencies():
    nested = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {module}"
        for name, path in MODULES.items()
        for module, inside, line in _imports(name, path)
        if inside and module.split(".")[0] not in OPTIONAL_DEPENDENCIES
    ]
    assert not nested, "imports inside functions or classes:\n" + "\n".join(nested)


def test_folders_import_only_lower_floors():
    wrong = []
    for name, targets in _internal_graph().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in FLOORS:
            continue  # the root __init__ re-exports the public names
        for target in targets:
            other = target.split(".")
            if len(other) < 2 or other[1] == parts[1]:
                continue
            if other[1] not in FLOORS or FLOORS[other[1]] >= FLOORS[parts[1]]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "imports against the floors " + str(FLOORS) + ":\n" + "\n".join(wrong)


#: Sizes a newcomer can read: no source file over 600 lines, no class over 400, the engine's
#: facade at most 300 (its collaborators hold the rest; docs/architecture.md).
MAX_FILE_LINES, MAX_CLASS_LINES, MAX_FACADE_LINES = 600, 400, 300


def _sources() -> List[Path]:
    repo = ROOT.parent
    return sorted(p for folder in ("torchtune_offload", "recipes", "scripts") for p in (repo / folder).rglob("*.py"))


def test_no_source_file_or_class_is_too_long():
    long = []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT.parent)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(ROOT.parent)}: class {node.name} has "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "split these by concern:\n" + "\n".join(long)


def test_the_engine_is_a_facade():
    tree = ast.parse((ROOT / "optim" / "offload_optimizer.py").read_text())
    facade = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OffloadOptimizer")
    assert facade.end_lineno - facade.lineno + 1 <= MAX_FACADE_LINES


#: Functions a reader takes in whole: none over 80 lines (from ``def`` to its last line, a nested
#: function counted in its parent too), and at most 8 over 60.
MAX_FUNCTION_LINES, LONG_FUNCTION_LINES, MAX_LONG_FUNCTIONS = 80, 60, 8


def test_no_function_is_too_long():
    too_long, long = [], []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(ROOT.parent)}: {node.name} has {lines} lines"
                if lines > MAX_FUNCTION_LINES:
                    too_long.append(where)
                if lines > LONG_FUNCTION_LINES:
                    long.append(where)
    assert not too_long, f"split these, over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(too_long)
    assert len(long) <= MAX_LONG_FUNCTIONS, (f"{len(long)} functions over {LONG_FUNCTION_LINES} lines, at most "
                                             f"{MAX_LONG_FUNCTIONS} may be; split some of these:\n" + "\n".join(long))
