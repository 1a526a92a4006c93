"""scripts/bench/fsdp_offload_rss.py: each rank's engine over its FSDP2 shards holds the host bytes the
pre-flight plans for it (memory_report agrees to the byte), and the rank's RSS grows by the plan
within 10%."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.recipe_harness import working_tree_env
from torchtune_offload.bench.machine import cpu_name

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("options", [[], ["--offload-gradients", "--accumulation", "2"]],
                         ids=["after-backward", "offload-gradients-overlap"])
def test_each_ranks_rss_grows_by_the_planned_host_memory(options):
    # 12 linears of 2048 x 2048 in bf16 over 2 ranks: 25.2M parameters a rank, 8 bytes each (copy, gradient
    # buffer, two bf16 states; with offload_gradients and 2 micro-batches the staging ring too), so the
    # process's own ~15 MB of noise stays under a tenth of the plan.
    out = subprocess.run([sys.executable, "scripts/bench/fsdp_offload_rss.py", "--layers", "12", "--width", "2048",
                          *options], cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith(f"{cpu_name()}, torch ") and "over 2 ranks" in out.stdout.splitlines()[0]
    rows = re.findall(r"^\| (\d) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([0-9.]+) \|$", out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["0", "1"], out.stdout
    for _, numel, plan, report, grown, ratio in rows:
        assert int(numel) == 12 * 2048 * 2048 // 2 and int(plan) == int(report) >= 8 * int(numel), out.stdout
        assert 0.95 <= int(grown) / int(plan) <= 1.10, out.stdout
