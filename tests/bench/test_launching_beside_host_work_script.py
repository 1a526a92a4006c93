"""scripts/bench/bench_launching_beside_host_work.py: the launching thread's micro-batch beside the
engine's host addition on other threads, under both OpenMP wait policies, in one table."""

import os
import re

import pytest

from tests import zygote


def test_prints_each_host_thread_count_under_both_wait_policies():
    out = zygote.run_script("bench/bench_launching_beside_host_work.py", "--model", "1B", "--micro-batches", "2",
                            "--elements", "70000")
    assert out.returncode == 0, out.stderr[-3000:]
    cores = len(os.sched_getaffinity(0))
    assert re.search(rf"^.+, {cores} cores, torch .+; llama3_2 1B at width 64, one intra-op thread, micro-batches "
                     r"of 1 x 16 tokens \(median of 2\); host addition: an fp32 sum of a bf16 gradient of 70000 "
                     r"elements, repeated$", out.stdout, flags=re.M)
    assert "| OMP_WAIT_POLICY=unset: ms | x none | OMP_WAIT_POLICY=PASSIVE: ms | x none |" in out.stdout
    rows = re.findall(r"^\| (none|on \d+ threads?) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$",
                      out.stdout, flags=re.M)
    expected = ["none", *(f"on {n} thread{'s' if n > 1 else ''}" for n in sorted({max(1, cores - 1), cores}))]
    assert [row[0] for row in rows] == expected
    assert rows[0][2] == rows[0][4] == "1.00" and all(float(v) > 0 for row in rows for v in row[1:])


@pytest.mark.parametrize("args, message", [
    (["--micro-batches", "0"], "--micro-batches must be at least 1"),
    (["--model", "13B"], "13B"),
])
def test_bad_arguments_are_refused_naming_the_fix(args, message):
    out = zygote.run_script("bench/bench_launching_beside_host_work.py", *args)
    assert out.returncode == 2 and message in out.stderr
