"""scripts/bench/bench_host_step.py prints each chosen row beside its baseline, the clipped rows included."""

import re

from tests import zygote

CLIPPED = ["engine, bf16 (default policy), clipped (scaled, then stepped)",
           "engine, fp32 master / bf16 device, fused pass, clipped: scaled, then stepped",
           "engine, fp32 master / bf16 device, fused pass, clipped: factor in the pass",
           "engine, bf16, torchtune_offload AdamW8bit states, clipped: scaled, then stepped",
           "engine, bf16, torchtune_offload AdamW8bit states, clipped: factor in the pass"]


def test_bench_host_step_prints_the_clipped_rows():
    out = zygote.run_script("bench/bench_host_step.py", "--params", "200000", "--steps", "10", "--threads", "1",
                            "--rows", "clipped", "--baseline", "torch fused AdamW, bf16")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 1 threads, torch .+; [0-9.]+M parameters in [0-9]+ Llama-shaped tensors", out.stdout,
                     flags=re.M)
    rows = re.findall(r"^\| ([^|]+) \| ([0-9]+) \| ([0-9.]+)x \|$", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["torch fused AdamW, bf16", *CLIPPED]
    assert rows[0][2] == "1.00" and all(int(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_bench_host_step_prints_the_fp32_sum_rows_kept_and_fresh():
    out = zygote.run_script("bench/bench_host_step.py", "--params", "200000", "--steps", "10", "--threads", "1",
                            "--rows", "fp32 gradient sums", "--baseline", "torch fused AdamW, bf16")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^\| ([^|]+) \| ([0-9]+) \| ([0-9.]+)x \|$", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["torch fused AdamW, bf16",
                                    "engine, bf16, fp32 gradient sums, rounded into a kept buffer",
                                    "engine, bf16, fp32 gradient sums, rounded into a new tensor each step (before)"]
    assert all(int(r[1]) > 0 for r in rows)
