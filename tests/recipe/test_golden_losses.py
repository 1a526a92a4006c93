"""Refactors change no computation: the recipes' losses and gradient norms, bit for bit.

``golden_losses.json`` holds what nine representative runs logged (full, LoRA and distributed
recipes; plain AdamW, ``OffloadOptimizer`` with and without offloaded gradients, optimizer in
backward, accumulation, clipping, an epoch-boundary checkpoint). The runs and how they are replayed
(in a child process with torch's, MKL's and oneDNN's kernels pinned, so that one recording holds
on AVX2 and AVX-512 CPUs alike) are in ``tests/recipe/golden_runs.py``. A change that is meant
to alter the numbers must say so and record them anew: ``python -m tests.recipe.golden_runs --record``.
"""

import json
import os

import pytest
import torch

from tests.recipe import golden_runs
from tests.recipe.golden_runs import OVERLAPPED, PINNED_CAPABILITY, PINNED_ENV, RUNS, case_id

RECORDING = json.loads(golden_runs.RECORDING_PATH.read_text())
GOLDEN = RECORDING["runs"]
CASES = [(n, False) for n in sorted(RUNS)] + [(n, True) for n in sorted(OVERLAPPED)]
TEST = "test_losses_are_bit_identical_to_the_recording"


def test_every_golden_run_is_replayed():
    assert set(RUNS) == set(GOLDEN) and set(OVERLAPPED) <= set(RUNS)


def test_the_recording_was_made_in_the_environment_the_replay_pins():
    assert RECORDING["pinned_env"] == PINNED_ENV


@pytest.fixture(scope="module")
def replayed(request, tiny_assets, tmp_path_factory):
    """The selected cases of the test below, replayed in one pinned child process (torch and
    torchtune load once for all of them)."""
    selected = [item.callspec.params for item in request.session.items
                if item.module is request.module and getattr(item, "originalname", None) == TEST]
    cases = [case_id(p["name"], p["overlap"]) for p in selected]
    return golden_runs.replay_pinned(cases, tiny_assets, tmp_path_factory.mktemp("golden") / "replay.json")


def _has_avx2() -> bool:
    """Whether this CPU runs torch's AVX2 kernels (cpuinfo's answer, as torch gives it; False off x86)."""
    return getattr(torch.cpu, "_is_avx2_supported", lambda: False)()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason=f"recorded with {golden_runs.THREADS} threads")
@pytest.mark.skipif(torch.__version__ != RECORDING["torch"], reason=f"recorded with torch {RECORDING['torch']}")
@pytest.mark.skipif(not _has_avx2(), reason=f"recorded with torch's {PINNED_CAPABILITY} kernels; this CPU has no AVX2")
@pytest.mark.parametrize("name, overlap", CASES)
def test_losses_are_bit_identical_to_the_recording(name, overlap, replayed):
    assert replayed["capability"] == PINNED_CAPABILITY, (
        f"the replay ran torch's {replayed['capability']} kernels: ATEN_CPU_CAPABILITY={PINNED_ENV['ATEN_CPU_CAPABILITY']} "
        "did not take in the child")
    result = replayed["runs"][case_id(name, overlap)]
    assert "error" not in result, result.get("error")
    expected = [{k: float(v) for k, v in row.items()} for row in GOLDEN[name]]
    assert result["rows"] == expected
