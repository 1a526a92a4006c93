"""The planner's host prediction against the measured peak RSS of a real ``tune run`` (tiny model, CPU)."""

import re
import subprocess
import sys
from pathlib import Path

from tests.recipe_harness import tiny_asset_overrides, working_tree_env

REPO = Path(__file__).resolve().parents[2]


def test_predicted_host_peak_is_within_10_percent_of_the_measured_rss(tiny_assets):
    cmd = [sys.executable, "scripts/plan_accuracy.py", "--config", "configs/tiny/full.yaml",
           *tiny_asset_overrides(tiny_assets), "--steps", "3"]
    proc = subprocess.run(cmd, cwd=REPO, env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = re.search(r"^\| peak host memory \(RSS\) \| ([0-9.]+) \| ([0-9.]+) \| ([+-][0-9.]+)% \|$", proc.stdout, re.M)
    assert row, proc.stdout
    predicted, measured, error = map(float, row.groups())
    assert predicted > 0 and measured > 0
    assert abs(error) <= 10, proc.stdout
