"""scripts/bench/bench_planner.py times the planner against an earlier tree, run in turns, and compares
their memory figures (the planner's 60 s target, docs/planner.md)."""

import importlib.util
import json
import re
import subprocess

import pytest

from tests import zygote
from tests.recipe_harness import REPO


def _script():
    spec = importlib.util.spec_from_file_location("bench_planner", REPO / "scripts/bench/bench_planner.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(*args: str) -> int:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True).returncode


def _in_git_checkout() -> bool:
    return _git("rev-parse", "HEAD") == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="the baseline tree comes from git")
def test_the_script_times_both_trees_compares_their_figures_and_scales_to_the_reference():
    out = zygote.run_script("bench/bench_planner.py", "--config", "configs/tiny/full.yaml", "--baseline", "HEAD",
                            "--rounds", "1", "--machine", "none", "--plan-args=--no-fine-tunes --variants config,adamw",
                            "--reference-seconds", "100", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"^CPU: .+; \d+ cores .+; torch .+; 1 rounds, the trees in turns$", out.stdout, flags=re.M)
    assert "this tree's nothing more" in out.stdout
    rows = re.findall(r"^\| configs/tiny/full.yaml \| (now|HEAD) \| ([0-9.]+) \| ([0-9.]+) \| (.*) \| (.*) \|$",
                      out.stdout, flags=re.M)
    assert [r[0] for r in rows] == ["now", "HEAD"], out.stdout
    (_, now_wall, now_cpu, _, _), (_, old_wall, _, ratio, figure) = rows
    assert float(now_wall) > 0 and float(now_cpu) > 0 and re.fullmatch(r"[0-9.]+x", ratio)
    assert "2 plans compared" in figure and "the config differs" not in figure, figure
    if _git("diff", "--quiet", "HEAD", "--", "torchtune_offload", "configs") == 0:
        # The same code plans the same figures (the process baseline each run measures left out).
        assert figure.startswith("0.00% (identical;"), figure
    assert re.search(r"^- configs/tiny/full.yaml: \d+-\d+ s$", out.stdout, flags=re.M), out.stdout


def test_the_factor_and_the_estimates_scale_this_trees_times_by_the_old_trees_slowdown():
    module = _script()
    # The old planner took 50 and 60 s here and 150 s there: 2.5-3x slower; this one took 10-20 s.
    assert module.scaled(150, [60, 50], [20, 10]) == (2.5, 3.0, 25.0, 60.0)


def test_the_figures_name_what_only_one_tree_planned():
    module = _script()
    old, new = {"config": {}, "torchao": {}}, {"config": {}, "fine-tune LoRA": {}}
    assert module.compared(old, new) == "1 plans compared; only old: torchao; only now: fine-tune LoRA"
    assert module.compared(old, old) == "2 plans compared"


def test_bad_options_are_refused_naming_them(capsys):
    module = _script()
    cases = [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--config", "configs/none.yaml"], "--config: not found"),
        (["--reference-seconds", "151"], "--reference-seconds needs --baseline"),
        (["--baseline", "HEAD", "--reference-seconds", "-1"], "--reference-seconds needs --baseline"),
    ]
    if _in_git_checkout():
        cases.append((["--baseline", "no-such-revision-0"], "--baseline: no-such-revision-0 is not a commit"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as raised:
            module.parse_args(argv)
        assert raised.value.code == 2 and message in capsys.readouterr().err, argv


@pytest.mark.skipif(not _in_git_checkout(), reason="needs a git checkout")
def test_an_export_names_the_revision_git_cannot_export_and_the_configs_its_tree_lacks(tmp_path):
    module = _script()
    with pytest.raises(ValueError, match="--baseline no-such-revision-0: git archive failed"):
        module.export_tree("no-such-revision-0", tmp_path / "a", ["configs/tiny/full.yaml"])
    (tmp_path / "b").mkdir()
    with pytest.raises(ValueError, match="--config: not in --baseline HEAD's tree: configs/none.yaml"):
        module.export_tree("HEAD", tmp_path / "b", ["configs/tiny/full.yaml", "configs/none.yaml"])


def test_the_host_peaks_leave_out_the_process_baseline_each_run_measures(tmp_path):
    module = _script()
    plans = {"plans": [{"name": "config", "device_bytes": 10, "paged_bytes": 0, "host_bytes": 100,
                        "host_parts": {module.PROCESS_BASELINE: 30, "training: optimizer state": 70}},
                       {"name": "torchao", "device_bytes": None, "paged_bytes": 0, "host_bytes": None}],
             "fine_tunes": [{"name": "LoRA", "device_bytes": 5, "paged_bytes": 0, "host_bytes": 40, "host_parts": {}}]}
    (tmp_path / "plan.json").write_text(json.dumps(plans))
    assert module.peaks(tmp_path / "plan.json") == {
        "config": {"device_bytes": 10, "paged_bytes": 0, "host_bytes": 70},
        "torchao": {"device_bytes": None, "paged_bytes": 0, "host_bytes": None},
        "fine-tune LoRA": {"device_bytes": 5, "paged_bytes": 0, "host_bytes": 40}}


def test_the_largest_difference_is_over_the_peaks_both_trees_planned():
    module = _script()
    gib = 2**30
    old = {"config": {"device_bytes": 20 * gib, "paged_bytes": 0, "host_bytes": 60 * gib},
           "adamw": {"device_bytes": 75 * gib, "paged_bytes": 0, "host_bytes": None},
           "gone": {"device_bytes": gib, "paged_bytes": 0, "host_bytes": gib}}
    new = {"config": {"device_bytes": 20 * gib, "paged_bytes": 0, "host_bytes": 61 * gib},
           "adamw": {"device_bytes": 75 * gib, "paged_bytes": 0, "host_bytes": 3 * gib},
           "new": {"device_bytes": 9 * gib, "paged_bytes": 0, "host_bytes": gib}}
    worst, where = module.largest_difference(old, new)
    assert worst == pytest.approx(1 / 60) and where == "config host 60.00 -> 61.00 GiB"
    assert module.largest_difference(old, old) == (0.0, "identical")
