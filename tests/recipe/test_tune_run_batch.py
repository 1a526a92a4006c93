"""tests/recipe/tune_run_batch.py gives each command the exit status and output a ``tune`` process would."""

import json
import sys
from pathlib import Path

from tests import zygote
from tests.recipe.tune_run_batch import run
from tests.recipe_harness import tiny_asset_overrides, working_tree_env

REPO = Path(__file__).resolve().parents[2]


def test_exit_statuses_are_those_of_a_process():
    help_ = run(["--help"])  # argparse prints and exits 0
    assert help_["returncode"] == 0 and "usage: tune" in help_["output"]
    bad = run(["no-such-subcommand"])  # argparse's usage error: status 2, message on stderr
    assert bad["returncode"] == 2 and "invalid choice" in bad["output"]


def test_an_uncaught_exception_is_status_1_with_its_traceback(tiny_assets, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # tune run takes the recipe's path relative to here
    result = run(["run", "recipes/full_finetune_single_device.py", "--config", "configs/tiny/full.yaml",
                  f"output_dir={tmp_path}", *tiny_asset_overrides(tiny_assets), "batch_size=0"])
    assert result["returncode"] == 1
    assert "Traceback" in result["output"] and "batch_size=0: must be an integer >= 1" in result["output"]


def test_each_command_gets_its_own_line_as_it_ends(tmp_path):
    commands = tmp_path / "commands.json"
    commands.write_text(json.dumps([["--help"], ["no-such-subcommand"]]))
    out = tmp_path / "results.jsonl"
    proc = zygote.run([sys.executable, "-m", "tests.recipe.tune_run_batch", str(commands), str(out)], cwd=REPO,
                          env=working_tree_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [json.loads(line)["returncode"] for line in out.read_text().splitlines()] == [0, 2]
