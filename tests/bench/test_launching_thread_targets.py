"""scripts/bench/bench_launching_thread.py's op targets for ``update_on: device`` and FP8 device
weights: at most 1.10x plain AdamW's aten ops (FP8: plain AdamW's plus the ops its design needs,
counted apart as they run). Op counts are deterministic; seconds are held to no target here, only
FP8's design seconds checked to be stated."""

import json
import re

from tests import zygote

ACCUM = 2
#: llama3_2 1B narrowed: 16 layers of seven linears, each held in FP8.
HELD = 16 * 7
#: Per held weight: the quantization after its host step (the scales: norm and six; the values:
#: three; the scales in the weight's dtype: one), and two a widening, three widenings a micro-batch
#: (the forward, its recomputation, the backward).
QUANTIZE_OPS, WIDEN_OPS = 11, 2


def test_device_update_and_fp8_stay_within_their_op_targets(tmp_path):
    out = zygote.run_script("bench/bench_launching_thread.py", "--model", "1B", "--rounds", "1", "--steps", "1",
                            "--accum", str(ACCUM), "--modes", "fp8,update-on-device",
                            "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    plain = results["plain AdamW"]
    device = results["update_on: device, overlap"]
    fp8 = results["device_weights: fp8, offload_gradients"]
    assert plain["design_ops"] is None and device["design_ops"] is None
    assert plain["design_seconds"] is None and device["design_seconds"] is None
    # The seconds of its quantizations and widenings, timed apart in further steps (not a target here).
    assert 0 < fp8["design_seconds"] < fp8["seconds"]
    assert device["ops"] <= 1.10 * plain["ops"]
    assert fp8["design_ops"] == HELD * (QUANTIZE_OPS + 3 * ACCUM * WIDEN_OPS)
    assert fp8["ops"] <= 1.10 * (plain["ops"] + fp8["design_ops"])
    # The table states them, and what they are.
    row = re.search(r"^\| device_weights: fp8, offload_gradients \| [0-9.]+ \| [0-9.]+ \| ([0-9.]+) \| [0-9.]+ \|"
                    r".*\| (\d+) \| ([0-9.]+) \| \d+ \|$", out.stdout, flags=re.M)
    assert row and float(row[1]) == round(fp8["design_seconds"], 3) and int(row[2]) == fp8["design_ops"]
    assert "Design ops and s: what FP8 device weights' design needs" in out.stdout
