"""The module fixture of the in-process recipe tests: torch on at most two threads, and tiktoken's
cache off (it caches ranks by path string; the runs read the files this test run built)."""

import os
from typing import Iterator

import pytest
import torch


def cpu_recipe_setup() -> Iterator[None]:
    """The fixture's body; use as ``_cpu_setup = pytest.fixture(autouse=True, scope="module")(cpu_recipe_setup)``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        yield
    torch.set_num_threads(threads)
