"""`tune run recipes/<file>.py` finds our recipes after `pip install .` and after `pip install -e .`.

torchtune ships a top-level ``recipes`` package that refuses to be imported, and ``tune run`` runs
a custom recipe as the module ``recipes.<file>`` with the working directory appended *after*
site-packages. Each test installs the project (no dependencies, no build isolation: seconds) into
a fresh virtual environment that holds such a decoy ``recipes`` package, and checks from the
repository root, with the working directory appended to ``sys.path`` as ``tune run`` does, that
``recipes.full_finetune_single_device`` resolves to our file.
"""

import subprocess
import sys
import tarfile
import venv
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[1]
# What an install needs from the repository (the rest would only slow the copy down).
INSTALL_FILES = ["pyproject.toml", "setup.py", "README.md", "_torchtune_offload_recipes.py",
                 "torchtune_offload_recipes.pth", "torchtune_offload", "recipes"]
DECOY = 'raise ModuleNotFoundError("the torchtune recipes directory is not a package")\n'
# How `tune run` imports a custom recipe: no script directory first, the working directory last.
RESOLVE = (
    "import importlib.util, os, sys; sys.path.append(os.getcwd()); "
    "print(importlib.util.find_spec('recipes.full_finetune_single_device').origin)"
)


def _copy_project(dst: Path) -> None:
    archive = dst.with_suffix(".tar")
    with tarfile.open(archive, "w") as tar:
        for name in INSTALL_FILES:
            tar.add(REPO / name, arcname=name, filter=lambda t: None if "__pycache__" in t.name else t)
    with tarfile.open(archive) as tar:
        tar.extractall(dst, filter="data")


def _venv_with_decoy(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    (Path(purelib) / "recipes").mkdir()
    (Path(purelib) / "recipes" / "__init__.py").write_text(DECOY)
    return python


@pytest.mark.skipif(sys.platform != "linux" or sys.version_info < (3, 11), reason="needs python -P (3.11+), Linux venv layout")
@pytest.mark.parametrize("editable", [False, True], ids=["pip-install", "pip-install-e"])
def test_tune_run_finds_our_recipes_after_install(editable, tmp_path):
    project = tmp_path / "project"
    _copy_project(project)
    python = _venv_with_decoy(tmp_path / "venv")
    # The venv's own setuptools may predate pyproject's minimum; lend it this interpreter's (on
    # PYTHONPATH, whose .pth files are not run, so this interpreter's hook cannot leak in).
    build_env = {"PYTHONPATH": str(Path(setuptools.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    install = [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    result = subprocess.run(
        install + (["-e", "."] if editable else ["."]),
        cwd=project, env=build_env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    if not editable:  # the fused step's C source is package data, compiled where it is installed
        installed = list((tmp_path / "venv").glob("lib/python*/site-packages/torchtune_offload/optim/fused_adamw.c"))
        assert len(installed) == 1

    found = subprocess.run(
        [python, "-P", "-c", RESOLVE], cwd=project, env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == project / "recipes" / "full_finetune_single_device.py"

    # Outside this repository the hook steps aside and the decoy is found: it is really in the way.
    elsewhere = subprocess.run(
        [python, "-P", "-c", RESOLVE], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60,
    )
    assert "not a package" in elsewhere.stderr, elsewhere.stdout + elsewhere.stderr

