"""scripts/plan_vs_sweep.py sets the planner's JSON beside a sweep's results.json."""

import json
import sys
from pathlib import Path

from tests import zygote
from tests.recipe_harness import working_tree_env

REPO = Path(__file__).resolve().parents[2]
GIB = 1024**3


def test_rows_join_by_variant_and_give_relative_errors(tmp_path):
    plan = {"plans": [
        {"name": "offload", "device_bytes": 11 * GIB, "paged_bytes": 0, "host_bytes": 9 * GIB},
        {"name": "paged_adamw8bit", "device_bytes": 8 * GIB, "paged_bytes": 2 * GIB, "host_bytes": 3 * GIB},
        {"name": "not_swept", "device_bytes": GIB, "paged_bytes": 0, "host_bytes": GIB},
    ]}
    results = [
        {"name": "offload", "peaks_gib": {"peak_memory_alloc": 10.0, "nvml_run_peak": 12.5, "host_rss_peak": 10.0}},
        {"name": "paged_adamw8bit", "peaks_gib": {"peak_memory_alloc": 8.0, "nvml_run_peak": 12.5,
                                                  "host_rss_peak": 4.0}},
        {"name": "failed", "peaks_gib": {}},
    ]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = zygote.run([sys.executable, "scripts/plan_vs_sweep.py", str(tmp_path / "plan.json"),
                          str(tmp_path / "results.json")], cwd=REPO, env=working_tree_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [r.split(" | ")[0] for r in rows] == ["| offload", "| paged_adamw8bit"]
    offload = rows[0].split(" | ")
    assert offload[1:4] == ["11.00", "-", "10.00"] and offload[4] == "+10.0%"
    assert offload[6] == "-12.0%" and offload[9].rstrip(" |") == "-10.0%"
    paged = rows[1].split(" | ")
    assert paged[2] == "2.00" and paged[6] == "-20.0%" and paged[9].rstrip(" |") == "-25.0%"
    assert out.stdout.rstrip().endswith("Not compared: not_swept (not in the sweep).")

    # No variant in both: an error naming each file's, not an empty table.
    (tmp_path / "results.json").write_text(json.dumps(results[2:]))
    out = zygote.run([sys.executable, "scripts/plan_vs_sweep.py", str(tmp_path / "plan.json"),
                      str(tmp_path / "results.json")], cwd=REPO, env=working_tree_env(),
                     capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no variant is in both files with measured peaks: the plan has offload, " \
        "paged_adamw8bit, not_swept, the sweep measured none" in out.stderr, out.stderr
