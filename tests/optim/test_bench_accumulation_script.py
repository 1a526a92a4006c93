"""scripts/bench/bench_accumulation.py runs on a small model and prints both paths and the host step side by side."""

import re

import pytest

from tests import zygote
from torchtune_offload.bench.machine import cpu_flags

ROWS = ["before: micro-batch on a CPU-only machine", "before: the copies, training thread (DMA on an accelerator)",
        "before: host work, the additions (ring thread)", "before: the additions alone (as on an accelerator)",
        "after: micro-batch on a CPU-only machine", "after: the copies, training thread (DMA on an accelerator)",
        "after: host work, the additions (ring thread)", "after: the additions alone (as on an accelerator)",
        "host AdamW step"]


@pytest.mark.parametrize("options,sum_bytes,step_bytes", [([], 2, 14), (["--grad-sum-dtype", "fp32"], 4, 20),
                                                          (["--master-dtype", "fp32"], 2, 28),
                                                          (["--optimizer", "adamw8bit"], 2, 10.06),
                                                          (["--optimizer", "adamw8bit", "--grad-sum-dtype", "fp32"], 4,
                                                           16.06)])
def test_bench_accumulation_prints_the_table(options, sum_bytes, step_bytes):
    out = zygote.run_script("bench/bench_accumulation.py", "--params", "300000", "--repeats", "2", "--warmup", "1",
                            *options)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^CPU: .+; torch threads: [0-9]+;", out.stdout, flags=re.M)
    assert re.search(r"^before: torch's add_; after: the engine's fused addition$", out.stdout, flags=re.M)
    rows = re.findall(r"^\| ([a-zA-Z:(), -]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+|inf) \| ([0-9.]*) \|$",
                      out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ROWS
    nbytes = {r[0]: float(r[3]) for r in rows}
    # A bf16 gradient chunk copied (read and written), then added into the sum (read, read and write).
    assert nbytes[ROWS[1]] == 4 and nbytes[ROWS[2]] == nbytes[ROWS[3]] == 2 + 2 * sum_bytes
    assert nbytes[ROWS[0]] == 6 + 2 * sum_bytes
    assert nbytes[ROWS[-1]] == step_bytes
    assert all(float(r[1]) > 0 for r in rows) and float(rows[-1][5]) == 1.0
    assert re.search(r"^Host work of a non-final micro-batch: before [0-9.]+ s, after [0-9.]+ s .+ beside this "
                     r"CPU's copies, [0-9.]+ alone", out.stdout, flags=re.M)


def test_bench_accumulation_refuses_an_unknown_precision():
    out = zygote.run_script("bench/bench_accumulation.py", "--grad-sum-dtype", "fp16")
    assert out.returncode == 2 and "--grad-sum-dtype=fp16: use fp32" in out.stderr


def test_bench_accumulation_refuses_an_optimizer_it_does_not_count():
    out = zygote.run_script("bench/bench_accumulation.py", "--optimizer", "sgd")
    assert out.returncode == 2 and "--optimizer=sgd: use one of adamw, adamw8bit" in out.stderr
    out = zygote.run_script("bench/bench_accumulation.py", "--optimizer", "adamw8bit", "--master-dtype", "fp32")
    assert out.returncode == 2 and "leave one of them out" in out.stderr


def test_bench_accumulation_compares_the_portable_build_where_the_cpu_has_avx512_bf16():
    out = zygote.run_script("bench/bench_accumulation.py", "--params", "300000", "--repeats", "2", "--warmup", "1",
                            "--before", "portable")
    if "avx512_bf16" in cpu_flags():
        assert out.returncode == 0, out.stderr[-3000:]
        assert re.search(r"^before: the fused addition without AVX512_BF16's rounding \(-mno-avx512bf16\); after: "
                         r"the engine's fused addition$", out.stdout, flags=re.M)
        assert re.search(r"^Host work of a non-final micro-batch: before [0-9.]+ s, after", out.stdout, flags=re.M)
    else:
        assert out.returncode == 2 and "--before=portable: this CPU has no AVX512_BF16" in out.stderr
    out = zygote.run_script("bench/bench_accumulation.py", "--before", "numpy")
    assert out.returncode == 2 and "--before=numpy: use one of torch, portable" in out.stderr
