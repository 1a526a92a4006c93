"""Installs the .pth hook that lets `tune run recipes/<file>.py` find this project's recipes.

Everything else is in pyproject.toml; setuptools has no declarative way to ship a .pth file.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "torchtune_offload_recipes.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]

    def get_output_mapping(self):
        # Editable installs link build outputs back to sources through this mapping.
        mapping = super().get_output_mapping()
        mapping[os.path.join(self.build_lib, PTH)] = os.path.abspath(PTH)
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
