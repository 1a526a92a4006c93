"""scripts/bench/quality_fp8.py trains the 78M llama3_2_mid in bf16 with bf16 and FP8 device weights, side by side."""

import math
import re

from tests import zygote

COLUMNS = ["bf16 device weights", "fp8, per-row scales", "fp8, per-tensor scales"]


def test_quality_script_prints_three_curves_from_one_start():
    out = zygote.run_script("bench/quality_fp8.py", "--steps", "2", "--every", "2", "--batch-size", "2", "--seq-len",
                            "8", "--vocab", "64", "--samples", "4", timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, \d+ threads, torch .+; llama3_2_mid \(77\.\dM parameters, bf16", out.stdout, flags=re.M)
    assert "| step | " + " | ".join(COLUMNS) + " |" in out.stdout
    rows = re.findall(r"^\| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", out.stdout, flags=re.M)
    assert [int(r[0]) for r in rows] == [1, 2]
    losses = [[float(x) for x in r[1:]] for r in rows]
    # Same init, same batch: the first losses differ only by the FP8 rounding of the layer weights.
    assert abs(losses[0][1] - losses[0][0]) < 0.05 and abs(losses[0][2] - losses[0][0]) < 0.05
    assert abs(losses[0][0] - math.log(128_256)) < 0.5
    assert all(math.isfinite(x) for row in losses for x in row)
    assert re.search(r"^mean loss of the last 2 steps: bf16 device weights [0-9.]+ \(\+0\.00%\), fp8, per-row scales ",
                     out.stdout, flags=re.M)
