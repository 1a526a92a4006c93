"""scripts/bench/pinned_memory_report.py runs end to end (on the CPU: nothing pinned, torchao refused)."""

import re
import sys
from pathlib import Path

from tests import zygote
from tests.recipe_harness import working_tree_env

REPO = Path(__file__).resolve().parents[2]


def test_the_report_prints_a_row_per_optimizer():
    out = zygote.run([sys.executable, "scripts/bench/pinned_memory_report.py", "--model",
                          "torchtune_offload.models.tiny_llama", "--device", "cpu"],
                         cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| (OffloadOptimizer[^|]*|torchao[^|]*) \| ([^|]*) \|",
                                                          out.stdout, re.M)}
    assert set(rows) == {"OffloadOptimizer", "OffloadOptimizer, master_dtype fp32", "torchao CPUOffloadOptimizer"}
    assert float(rows["OffloadOptimizer"]) > 0
    assert rows["torchao CPUOffloadOptimizer"].startswith("n/a: ValueError")  # it needs CUDA or XPU
    row = next(line for line in out.stdout.splitlines() if line.startswith("| OffloadOptimizer |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 8 and cells[6] == "-"  # no pinned allocator off CUDA
    float(cells[7])  # the available-memory drop is measured everywhere
