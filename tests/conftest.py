"""Shared test setup: the one GPU marker, and the tiny assets the recipe tests train on."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.recipe_harness import working_tree_env
from torchtune_offload.optim.stream_check import checked_streams

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_accelerator() -> bool:
    return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type in (
        "cuda",
        "xpu",
    )


def pytest_collection_modifyitems(config, items):
    if _has_accelerator():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or XPU device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """Builds the tiny model, tokenizer and data once per session with ``-m torchtune_offload.assets``.

    Returns:
        The directory holding ``model/``, ``tokenizer/`` and ``data/`` (see torchtune_offload/assets).
    """
    out = tmp_path_factory.mktemp("tiny_assets")
    # A fresh path per session, so tiktoken's cache (keyed by path string) cannot serve stale ranks.
    # PYTHONPATH: the working tree's package, never an installed copy.
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")
    result = subprocess.run(
        [sys.executable, "-m", "torchtune_offload.assets", "--output-dir", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, (
        f"python -m torchtune_offload.assets failed:\n{result.stdout}\n{result.stderr}"
    )
    return out


def pytest_addoption(parser):
    parser.addoption(
        "--checked-streams", action="store_true", default=False,
        help="run each test inside torchtune_offload.optim.stream_check.checked_streams(): the CPU emulation "
             "on virtual streams, every tensor access checked for happens-before",
    )


@pytest.fixture(autouse=True)
def _checked_streams(request):
    """With --checked-streams, the test runs on virtual streams (tests that enter checked_streams()
    themselves, marked ``streams_as_is``, run as they are)."""
    if not request.config.getoption("--checked-streams") or "streams_as_is" in request.keywords:
        yield
        return
    with checked_streams():
        yield
