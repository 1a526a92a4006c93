"""scripts/bench_gc_pauses.py times Python's garbage collector during offloaded training steps, as it
is, with setup frozen (as the recipes' loop does) and switched off."""

import re

from tests import zygote


def test_bench_gc_pauses_prints_each_mode_and_the_frozen_one_walks_less():
    out = zygote.run_script("bench_gc_pauses.py", "--models", "1B", "--steps", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, \d+ threads, torch .+; width 64, bf16, activation checkpointing, 4 micro-batches",
                     out.stdout, flags=re.M)
    number = r"([0-9.]+)"
    rows = re.findall(rf"^\| llama3_2 1B \| ([a-z -]+) \| {number} \| {number} / {number} / {number} \| "
                      rf"{number} / {number} / {number} \| {number} \| (\d+) \|$", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["as it is", "frozen after warm-up", "switched off"], out.stdout
    as_is, frozen, off = rows
    assert float(as_is[1]) > 0 and float(frozen[1]) > 0 and float(off[1]) > 0
    # Frozen, what setup made is no longer walked; switched off, nothing is collected.
    assert int(frozen[9]) < int(as_is[9]) / 10
    assert all(float(v) == 0 for v in off[2:9])
