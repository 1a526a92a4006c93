"""scripts/host_memory_8bit.py: 6 bytes per offloaded bf16 parameter plus absmax, as memory_report says and RSS shows."""

import re
import subprocess
import sys
from pathlib import Path

from tests.recipe_harness import working_tree_env

REPO = Path(__file__).resolve().parents[2]


def test_report_is_six_bytes_plus_absmax_and_rss_growth_matches_it():
    layers, width = 12, 2048  # 50.3M parameters: large enough that RSS noise stays well under 5%
    cmd = [sys.executable, "scripts/host_memory_8bit.py", "--layers", str(layers), "--width", str(width)]
    out = subprocess.run(cmd, cwd=REPO, env=working_tree_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = dict((name, (float(report), float(grown), float(ratio))) for name, report, grown, ratio in re.findall(
        r"^\| OffloadOptimizer, (.+?), offload_gradients \| ([0-9.]+) \| ([0-9.]+) \| ([0-9.]+) \|$", out.stdout,
        flags=re.M))
    assert set(rows) == {"torchtune_offload.AdamW8bit", "torch AdamW (bf16 states)"}, out.stdout
    numel, blocks = layers * width * width, layers * width * width // 256
    # Copy 2, gradient sum 2, two 1-byte states, and two fp32 absmax per block of 256.
    exact = re.search(r"^torchtune_offload\.AdamW8bit: memory_report (\d+) bytes \(staging ring (\d+)\)", out.stdout,
                      flags=re.M)
    assert int(exact.group(1)) - int(exact.group(2)) == 6 * numel + 8 * blocks
    assert rows["torchtune_offload.AdamW8bit"][0] == round((6 * numel + 8 * blocks) / numel, 3)
    assert rows["torch AdamW (bf16 states)"][0] == 8.0
    for name, (_, _, ratio) in rows.items():
        assert 0.95 <= ratio <= 1.05, (name, out.stdout)
