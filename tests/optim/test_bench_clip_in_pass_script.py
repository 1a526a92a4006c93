"""scripts/bench_clip_in_pass.py times a clipped window's host step both ways, beside the unclipped one."""

import re
import sys
from pathlib import Path

from tests import zygote
from tests.recipe_harness import working_tree_env

REPO = Path(__file__).resolve().parents[2]


def test_bench_clip_in_pass_prints_both_passes():
    cmd = [sys.executable, "scripts/bench_clip_in_pass.py", "--params", "300000", "--steps", "10", "--threads", "1"]
    out = zygote.run(cmd, cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 1 threads, torch .+; [0-9.]+M bf16 parameters in [0-9]+ Llama-shaped tensors", out.stdout,
                     flags=re.M)
    rows = re.findall(r"^\| ([A-Za-z0-9(), -]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$",
                      out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["AdamW8bit states (C pass)", "fp32 master, fused pass"]
    for _, unclipped, before, after, ratio, floor in rows:
        assert min(float(unclipped), float(before), float(after)) > 0
        assert abs(float(ratio) - float(after) / float(before)) < 0.01
        assert abs(float(floor) - float(after) / float(unclipped)) < 0.01
