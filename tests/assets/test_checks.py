"""Unit tests of torchtune_offload.assets.checks that need no built assets."""

from __future__ import annotations

import datasets

from torchtune_offload.assets.checks import _datasets_offline


def test_datasets_is_kept_offline_unless_the_environment_says(monkeypatch):
    # tests/conftest.py sets HF_DATASETS_OFFLINE before datasets loads; the command line
    # cannot, so the self-check switches datasets' config offline while it loads the JSON.
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with _datasets_offline():
        assert datasets.config.HF_HUB_OFFLINE is True
    assert datasets.config.HF_HUB_OFFLINE is False
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")  # an explicit choice is left alone
    with _datasets_offline():
        assert datasets.config.HF_HUB_OFFLINE is False
