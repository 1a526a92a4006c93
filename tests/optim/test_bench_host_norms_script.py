"""scripts/bench_host_norms.py times the host sums' norms one after another and side by side."""

import re

from tests import zygote


def test_bench_host_norms_prints_both_ways_for_both_dtypes():
    out = zygote.run_script("bench_host_norms.py", "--params", "300000", "--repeats", "3", "--threads", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, 2 threads, torch .+; [0-9.]+M parameters in [0-9]+ Llama-shaped tensors", out.stdout,
                     flags=re.M)
    rows = re.findall(r"^\| (bfloat16|float32) \| ([a-z ]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]*) \|$",
                      out.stdout, flags=re.M)
    assert [(r[0], r[1]) for r in rows] == [(d, w) for d in ("bfloat16", "float32")
                                           for w in ("one after another", "side by side")]
    for serial, parallel in (rows[0:2], rows[2:4]):
        # 300K parameters take microseconds: the printed seconds are too coarse to recompute the ratio.
        assert float(serial[4]) > 0 and float(parallel[4]) > 0 and serial[5] == "" and float(parallel[5]) > 0
