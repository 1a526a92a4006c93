"""Shared test setup: the one GPU marker, and the tiny assets the recipe tests train on."""

import os
import sys
from pathlib import Path

import pytest
import torch

from tests import zygote
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
    """Builds the tiny model, tokenizer and data once per pytest process with ``-m torchtune_offload.assets``.

    Returns:
        The directory holding ``model/``, ``tokenizer/`` and ``data/`` (see torchtune_offload/assets).
    """
    out = tmp_path_factory.mktemp("tiny_assets")
    # A fresh path per pytest process, so tiktoken's cache (keyed by path string) cannot serve stale ranks.
    # PYTHONPATH: the working tree's package, never an installed copy.
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")
    result = zygote.run(
        [sys.executable, "-m", "torchtune_offload.assets", "--output-dir", str(out)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, (
        f"python -m torchtune_offload.assets failed:\n{result.stdout}\n{result.stderr}"
    )
    return out


#: The engine's test files (host engine, offload_gradients, accumulation, clipping, overlap, master
#: weights, 8-bit states, device update, staging ring, FP8 device weights, resume) that
#: ``--also-checked-streams`` runs a second time on virtual streams.
ENGINE_TEST_FILES = (
    "tests/optim/test_offload_optimizer.py", "tests/optim/test_overlap.py", "tests/optim/test_master_weights.py",
    "tests/optim/test_staging.py", "tests/optim/test_update_on_device.py", "tests/optim/test_adamw8bit.py",
    "tests/optim/test_transfer_and_capabilities.py", "tests/optim/test_host_arena.py",
    "tests/optim/test_llama_width.py", "tests/optim/test_fused_step.py", "tests/optim/test_host_add.py",
    "tests/optim/test_fp8_weights.py", "tests/optim/test_slot_step.py", "tests/optim/test_handoff.py",
    "tests/optim/test_device_update_batches.py", "tests/optim/test_fp8_quantize_ops.py",
)
_PLAIN, _CHECKED = "plain", "checked"


def pytest_addoption(parser):
    parser.addoption(
        "--checked-streams", action="store_true", default=False,
        help="run each test inside torchtune_offload.optim.stream_check.checked_streams(): the CPU emulation "
             "on virtual streams, every tensor access checked for happens-before",
    )
    parser.addoption(
        "--also-checked-streams", action="store_true", default=False,
        help="run each test of the engine's files (ENGINE_TEST_FILES in tests/conftest.py) twice: as it is, "
             "and inside checked_streams() (its id ends in 'checked')",
    )


def pytest_generate_tests(metafunc):
    # The engine's tests twice in one pytest run: one xdist start, one collection, one balance of work.
    config = metafunc.config
    if not config.getoption("--also-checked-streams") or config.getoption("--checked-streams"):
        return
    path = Path(metafunc.definition.path).resolve().relative_to(REPO_ROOT).as_posix()
    as_is = metafunc.definition.get_closest_marker("streams_as_is") is not None
    if path in ENGINE_TEST_FILES and not as_is and "_checked_streams" in metafunc.fixturenames:
        metafunc.parametrize("_checked_streams", [_PLAIN, _CHECKED], indirect=True)


@pytest.fixture(autouse=True)
def _checked_streams(request):
    """The test runs on virtual streams with --checked-streams, or in its ``checked`` copy under
    --also-checked-streams (tests that enter checked_streams() themselves, marked ``streams_as_is``,
    run as they are)."""
    wanted = request.config.getoption("--checked-streams") or getattr(request, "param", _PLAIN) == _CHECKED
    if not wanted or "streams_as_is" in request.keywords:
        yield
        return
    with checked_streams():
        yield
