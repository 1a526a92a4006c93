"""Installs the .pth hook that lets `tune run recipes/<file>.py` find this project's recipes.

Everything else is in pyproject.toml; setuptools has no declarative way to ship a .pth file.
A regular install (`pip install .`) copies it through build_py; an editable install
(`pip install -e .`) builds its wheel from a strategy object instead, so the .pth is added there.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "torchtune_offload_recipes.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


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
