"""scripts/bench_eager_dispatch.py times a pass of a narrowed real architecture: its host dispatch."""

import re

from tests import zygote


def test_bench_eager_dispatch_prints_a_forward_and_a_backward_per_model():
    out = zygote.run_script("bench_eager_dispatch.py", "--models", "1B,8B", "--steps", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^.+, \d+ threads, torch .+; width 64, bf16, activation checkpointing, 1 x 16 tokens",
                     out.stdout, flags=re.M)
    rows = re.findall(r"^\| (llama[0-9_]+ [0-9]+B) \| ([0-9.]+) \| ([0-9.]+) \|$", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["llama3_2 1B", "llama3_1 8B"]
    assert all(float(forward) > 0 and float(backward) > 0 for _, forward, backward in rows)


def test_an_unknown_model_is_refused_naming_the_choices():
    out = zygote.run_script("bench_eager_dispatch.py", "--models", "70B")
    assert out.returncode == 2 and "--models: unknown 70B; use some of 1B, 3B, 8B" in out.stderr
