"""scripts/bench_clip_in_pass.py times a clipped window's host step both ways, beside the unclipped one."""

import re

from tests import zygote


def test_bench_clip_in_pass_prints_both_passes():
    out = zygote.run_script("bench_clip_in_pass.py", "--params", "300000", "--steps", "10", "--threads", "1")
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
