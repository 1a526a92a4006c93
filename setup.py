"""Two build steps pyproject.toml cannot declare.

1. Ships ``recipes/`` and ``configs/`` inside the package, as ``torchtune_offload/_shipped/``, so
   ``tune-offload`` finds them after a regular install (``pip install .``) from any directory. They
   stay at the repository's top level, where ``tune run recipes/<file>.py`` and the tests use them;
   every ``recipes/*.py`` and ``configs/**/*.yaml`` is copied, so a file added later needs no edit
   here. An editable install (``pip install -e .``) needs no copy: ``tune-offload`` reads the clone's
   folders next to the package (torchtune_offload/recipe/shipped.py).
2. Installs the .pth hook that lets ``tune run recipes/<file>.py`` find this project's recipes from a
   clone's root (torchtune's own top-level ``recipes`` package would shadow them). A regular install
   copies it through build_py; an editable install builds its wheel from a strategy object
   instead, so the .pth is added there.
"""

import glob
import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "torchtune_offload_recipes.pth"
SHIPPED = os.path.join("torchtune_offload", "_shipped")
SHIPPED_GLOBS = ["recipes/*.py", "configs/**/*.yaml"]


def _shipped_files():
    return sorted(f for pattern in SHIPPED_GLOBS for f in glob.glob(pattern, recursive=True))


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)
        for src in _shipped_files():
            dest = os.path.join(self.build_lib, SHIPPED, src)
            self.mkpath(os.path.dirname(dest))
            self.copy_file(src, dest, preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        shipped = [os.path.join(self.build_lib, SHIPPED, src) for src in _shipped_files()]
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)] + shipped


class _AlsoWritePth:
    """Wraps setuptools' editable strategy: whatever it writes, plus the recipes hook's .pth."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc_info):
        return self._strategy.__exit__(*exc_info)

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        with open(PTH, "rb") as f:
            wheel.writestr(PTH, f.read())


class EditableWheelWithPth(editable_wheel):
    # setuptools' editable wheel holds only its own .pth and finder: ours must be added to it.
    def _select_strategy(self, name, tag, build_lib):
        return _AlsoWritePth(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
