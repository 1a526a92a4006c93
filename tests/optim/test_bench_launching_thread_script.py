"""scripts/bench/bench_launching_thread.py: every mode side by side with plain AdamW, in one table."""

import json
import re

import pytest

from tests import zygote


def test_prints_each_mode_against_plain_adamw_with_ops_and_handoffs(tmp_path):
    out = zygote.run_script("bench/bench_launching_thread.py", "--model", "1B", "--rounds", "2", "--steps", "1",
                            "--accum", "2", "--modes", "overlap,torchao",
                            "--per-parameter", "--json", str(tmp_path / "r.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, \d+ threads, torch .+; llama3_2 1B at width 64, bf16, activation checkpointing, eager; "
                     r"2 micro-batches of 1 x 16 tokens a step, clip 1.0; 2 interleaved rounds", out.stdout, flags=re.M)
    rows = dict(re.findall(r"^\| ([^|]+) \| ([0-9.]+) \| ", out.stdout, flags=re.M))
    assert set(rows) == {"plain AdamW", "offload_gradients, overlap", "offload_gradients, overlap, hand-off per parameter"}
    results = json.loads((tmp_path / "r.json").read_text())["results"]
    assert results["plain AdamW"]["ratio"] == 1.0 and len(results["plain AdamW"]["ratios"]) == 2
    assert results["plain AdamW"]["handoffs"] is None and results["plain AdamW"]["ops"] > 1000
    # llama3_2 1B: 16 layers and the embedding (tied to the output) and the final norm, two backwards
    # a step; per parameter, each of its 146 tensors (the output shares the embedding's) once a backward.
    assert 2 * 16 < results["offload_gradients, overlap"]["handoffs"] <= 2 * (16 + 4)
    assert results["offload_gradients, overlap, hand-off per parameter"]["handoffs"] == 2 * 146
    # torchao's wrapper runs on CUDA and XPU only: named, with the reason, not dropped.
    assert re.search(r"^\| torchao's CPUOffloadOptimizer \| does not run here: .*CUDA", out.stdout, flags=re.M)


@pytest.mark.parametrize("args, message", [
    (["--modes", "overlap,fast"], "--modes: unknown fast; choose from host-ring, device-sums, overlap"),
    (["--device", "cuda"], "--device cuda: no CUDA device here"),
])
def test_bad_arguments_are_refused_naming_the_fix(args, message):
    out = zygote.run_script("bench/bench_launching_thread.py", *args)
    assert out.returncode == 2 and message in out.stderr
