"""Shared test setup: the one GPU marker, and tiny models trained side by side."""

import os

import pytest
import torch

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
