"""scripts/bench/bench_overlap.py runs end to end on the tiny model and reports both runs side by side."""

import re

from tests import zygote


def test_bench_overlap_prints_both_runs_and_equal_losses():
    out = zygote.run_script("bench/bench_overlap.py", "--model", "torchtune_offload.models.tiny_llama", "--device",
                            "cpu", "--dtype", "fp32", "--batch-size", "2", "--seq-len", "32", "--steps", "4",
                            "--grad-accum", "2", "--clip", "1.0", "--offload-gradients")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| (off|on) \| ([0-9.]+) \|", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["off", "on"] and all(float(r[1]) > 0 for r in rows)
    assert "largest loss difference 0." in out.stdout
    saved = re.search(r"^Step time saved: (-?[0-9.]+) s, (-?[0-9]+)% of the serial host step \(([0-9.]+) s\)", out.stdout,
                      flags=re.M)
    assert saved is not None and float(saved.group(3)) > 0
