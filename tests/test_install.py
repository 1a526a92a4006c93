"""Installing the project: ``tune-offload`` from any directory, and ``tune run recipes/<file>.py`` from a clone.

The acceptance test installs the project into a fresh virtual environment and runs what the README
shows from an empty directory. The hook test below checks the clone's ``tune run`` path.

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
INSTALL_FILES = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "_torchtune_offload_recipes.py",
                 "torchtune_offload_recipes.pth", "torchtune_offload", "recipes", "configs"]
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


def _pip_into(python: Path) -> list:
    """``pip install`` into the environment of ``python``, run by this interpreter's pip (``--python``):
    a venv made without pip is made in a fraction of a second, against seconds for ensurepip."""
    return [sys.executable, "-m", "pip", "--python", str(python), "install"]


def _venv_with_decoy(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)  # this interpreter's pip installs into it
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
    install = [*_pip_into(python), "-q", "--no-deps", "--no-build-isolation", "--no-index"]
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



# --- The acceptance test: `pip install <clone>`, then tune-offload from an empty directory ---------

RECIPES = ("full_finetune_single_device", "full_finetune_distributed", "lora_finetune_single_device")
TINY_CONFIGS = ("tiny/full", "tiny/full_distributed", "tiny/lora")


#: Names of the project's own entries in a site-packages folder (package, hook, dist-info, editable finder).
_PROJECT_ENTRIES = ("torchtune_offload", "editable___torchtune_offload", "editable__.torchtune_offload")


def _venv_on_these_dependencies(path: Path) -> Path:
    """A fresh virtual environment that imports this interpreter's installed dependencies.

    Not ``--system-site-packages``: that would also run this interpreter's ``.pth`` files, and a
    development machine's editable install of the project would put the clone ahead of the copy
    under test. A plain path line in a ``.pth`` adds site-packages to ``sys.path`` after the venv's
    own, without running the ``.pth`` files found there. Installing torch and torchtune from the
    registry instead would take minutes and a network; the dependency pins are still checked
    against these installed versions by pip.
    """
    venv.EnvBuilder(with_pip=False).create(path)  # this interpreter's pip installs into it
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    host = sorted({p for p in sys.path if p.endswith("-packages") and Path(p).is_dir()})
    # This interpreter's site-packages without the project itself: CI installs it there (a regular
    # install), and that copy would shadow the one under test (setuptools' editable finder comes
    # after the path-based one).
    views = []
    for i, site in enumerate(host):
        view = path / f"host_site_{i}"
        view.mkdir()
        for entry in Path(site).iterdir():
            if not entry.name.lower().replace("-", "_").lstrip("_").startswith(_PROJECT_ENTRIES):
                (view / entry.name).symlink_to(entry)
        views.append(str(view))
    (Path(purelib) / "host_dependencies.pth").write_text("\n".join(views) + "\n")
    return python


def _losses(output_dir: Path) -> list:
    """The per-step losses torchtune's DiskLogger wrote (``Step N | loss:X ...``)."""
    (log,) = (output_dir / "logs").glob("log_*.txt")
    return [float(field.split(":", 1)[1]) for line in log.read_text().splitlines()
            for field in line.split() if field.startswith("loss:")]


@pytest.mark.skipif(sys.platform != "linux", reason="Linux venv layout")
@pytest.mark.parametrize("editable", [False, True], ids=["pip-install", "pip-install-e"])
def test_tune_offload_from_an_empty_directory_after_install(editable, tmp_path):
    clone = tmp_path / "clone"
    _copy_project(clone)
    venv_dir = tmp_path / "venv"
    python = _venv_on_these_dependencies(venv_dir)
    # No build isolation and no index: the build uses this interpreter's setuptools (the venv's may
    # predate pyproject's minimum), and every dependency must already be satisfied here.
    build_env = {"PYTHONPATH": str(Path(setuptools.__file__).parents[1]), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [*_pip_into(python), "-q", "--no-build-isolation", "--no-index"] + (["-e"] if editable else [])
        + [str(clone)], cwd=tmp_path, env=build_env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    work = tmp_path / "empty"
    work.mkdir()
    # The venv is not activated: its commands run by their path, and nothing they start may need PATH.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"),
           "WANDB_MODE": "offline", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}

    def sh(command, *argv, timeout=300):
        """``command`` (a program of the venv: its python, tune-offload) with ``argv``, from ``work``."""
        return subprocess.run([str(venv_dir / "bin" / command), *argv], cwd=work, env=env, capture_output=True,
                              text=True, timeout=timeout)

    where = sh("python", "-c", "import torchtune_offload.cli as c; print(c.__file__); print(c.shipped_root())")
    assert where.returncode == 0, where.stderr
    module, root = where.stdout.split()
    if editable:  # the clone's package and its recipes/ and configs/
        assert Path(module).is_relative_to(clone) and Path(root) == clone
    else:  # the installed copy, with recipes/ and configs/ inside it
        assert Path(module).is_relative_to(venv_dir) and Path(root).is_relative_to(venv_dir)

    listed = sh("tune-offload", "ls")
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert {row[0] for row in rows if len(row) == 2} == set(RECIPES)
    assert set(TINY_CONFIGS) <= {row[-1] for row in rows}

    copied = sh("tune-offload", "cp", "tiny/full", "./my.yaml")
    assert copied.returncode == 0 and (work / "my.yaml").is_file(), copied.stderr
    if editable:
        return  # what follows runs the same code either way: the regular install's part

    before = sh("tune-offload", "run", "full_finetune_single_device", "--config", "tiny/full")
    assert before.returncode != 0 and " -m torchtune_offload.assets` (it writes" in before.stderr, before.stderr

    built = sh("python", "-m", "torchtune_offload.assets")
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "home" / ".cache" / "torchtune_offload" / "tiny" / "manifest.json").is_file()

    validated = sh("tune-offload", "validate", "--config", "tiny/full")
    assert validated.returncode == 0 and "well-formed" in validated.stdout, validated.stdout + validated.stderr

    for name, config in (("named", "tiny/full"), ("copied", "./my.yaml")):
        out = tmp_path / "runs" / name
        ran = sh("tune-offload", "run", "full_finetune_single_device", "--config", config,
                 "max_steps_per_epoch=2", "device=cpu", f"output_dir={out}")
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
        losses = _losses(out)
        assert len(losses) == 2 and all(0 < loss < 20 for loss in losses), losses
        assert (out / "epoch_0").is_dir()

    out = tmp_path / "runs" / "distributed"
    ran = sh("tune-offload", "run", "--nproc_per_node", "2", "full_finetune_distributed",
             "--config", "tiny/full_distributed", "device=cpu", f"output_dir={out}", timeout=600)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    losses = _losses(out)
    assert len(losses) == 20 and losses[-1] < losses[0], losses  # 20 steps of the config: it learns
    assert list(work.iterdir()) == [work / "my.yaml"]  # every output went where output_dir said
