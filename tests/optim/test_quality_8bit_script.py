"""scripts/bench/quality_8bit.py trains the 78M llama3_2_mid with the three optimizers and prints their curves side
by side."""

import math
import re

import pytest

from tests import zygote

COLUMNS = ["torch AdamW (fp32 states)", "bitsandbytes AdamW8bit", "torchtune_offload AdamW8bit"]


def test_quality_script_prints_three_curves_from_one_start():
    pytest.importorskip("bitsandbytes")
    out = zygote.run_script("bench/quality_8bit.py", "--steps", "3", "--every", "2", "--batch-size", "2", "--seq-len",
                            "8", "--vocab", "64", "--samples", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, \d+ threads, torch .+; llama3_2_mid \(77\.\dM parameters", out.stdout, flags=re.M)
    assert "| step | " + " | ".join(COLUMNS) + " |" in out.stdout
    rows = re.findall(r"^\| (\d+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", out.stdout, flags=re.M)
    assert [int(r[0]) for r in rows] == [1, 2, 3]  # step 1, every 2, and the last step
    losses = [[float(x) for x in r[1:]] for r in rows]
    # Same init, same batch: the first loss (before any step) is the same number in all three runs,
    # about log(128256) for the checkpoints' init scheme.
    assert losses[0][0] == losses[0][1] == losses[0][2]
    assert abs(losses[0][0] - math.log(128_256)) < 0.5
    assert all(math.isfinite(x) for row in losses for x in row)
    assert re.search(r"^largest per-step loss gap, ours vs bitsandbytes: [0-9.]+; ", out.stdout, flags=re.M)
    assert re.search(r"^wall time: torch AdamW \(fp32 states\) \d+ s, ", out.stdout, flags=re.M)
