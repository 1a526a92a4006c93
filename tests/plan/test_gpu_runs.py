"""gpu_runs.json, the one file of recorded GPU measurements: every row parses, the calibration's runs are its
runs, and docs/gpu_results.md holds the tables generated from it."""

import dataclasses
import datetime
import json
import re
from pathlib import Path

import pytest

from torchtune_offload.plan import gpu_tables
from torchtune_offload.plan.gpu_tables import BEGIN, END, MODELS, load, marked_block, run_rows, tables
from torchtune_offload.plan.recorded_runs import GAPS, main, recorded_runs
from torchtune_offload.plan.speed import StepWork

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "gpu_results.md"
#: Every kind of entry the file holds, each with its date, commit and device.
ENTRIES = {"runs": lambda data: run_rows(data), "profiles": lambda data: data["profiles"],
           "tests": lambda data: data["tests"], "probes": lambda data: data["probes"],
           "pinned": lambda data: data["pinned"], "gradient_math": lambda data: data["gradient_math"]}


def test_the_page_holds_the_tables_generated_from_the_data_file():
    page = PAGE.read_text()
    assert page.count(BEGIN) == page.count(END) == 1 and page.index(BEGIN) < page.index(END)
    assert marked_block(page) == tables(), (
        "docs/gpu_results.md is not what gpu_runs.json gives: "
        "python -m torchtune_offload.plan.recorded_runs --tables --write docs/gpu_results.md")


@pytest.mark.parametrize("kind", sorted(ENTRIES))
def test_every_entry_is_keyed_by_an_iso_date_a_commit_and_a_device_with_what_made_it(kind):
    data = load()
    entries = ENTRIES[kind](data)
    assert entries
    for entry in entries:
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]), entry
        datetime.date.fromisoformat(entry["date"])
        assert re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]), entry
        assert entry["device"].strip() and entry["device"] in data["devices"], entry
        assert entry.get("command", "").strip() or entry.get("what", "").strip(), entry


def test_every_run_gives_its_settings_and_a_figure_or_why_it_has_none():
    fields = {f.name for f in dataclasses.fields(StepWork)}
    for run in run_rows(load()):
        assert run["model"] in MODELS and run["seq"] == 2048, run
        assert run["batch"] >= 1 and run["accumulation"] >= 1 and run["steps"] >= 10, run
        assert run["gpu_memory_gib"] is None or run["gpu_memory_gib"] > 0, run
        assert set(run.get("engine", {})) <= fields, run
        assert run.get("gap") is None or run["gap"] in GAPS, run
        measured = ("tokens_per_second" in run) or ("step_seconds" in run)
        assert measured == (run["status"] == "ok"), run
        if "loss" in run:
            assert len(run["loss"]) == 2 and run["loss"][1] < run["loss"][0], run


def test_the_calibration_runs_are_the_files_runs_that_ran():
    rows = [run for run in run_rows(load()) if run["status"] == "ok"]
    runs = recorded_runs()
    assert len(runs) == len(rows) == 47
    for run, row in zip(runs, rows):
        assert (run.date, run.commit, run.device) == (row["date"], row["commit"], row["device"])
        assert run.samples_per_micro_batch == row["batch"] and run.work.micro_batches == row["accumulation"]
        assert (run.gap.label if run.gap else None) == row.get("gap")
        assert run.source.startswith(f"gpu_results.md, {row['date']}, {row['commit']}: {MODELS[row['model']]}, ")
    # A run that gives only its step's seconds: the tokens of a step over them.
    bench = next(r for r in runs if r.name == "bench_overlap, overlap off")
    assert bench.measured_tokens_per_second == pytest.approx(2 * 2048 / 0.382)
    # Every gap the code knows is shown by a run.
    assert {r.gap.label for r in runs if r.gap} == set(GAPS)


def test_the_file_and_the_page_speak_of_the_project_not_of_how_the_work_was_organised():
    for path in (gpu_tables.GPU_RUNS, PAGE):
        text = path.read_text()
        assert not re.search(r"\bsession|\blease|\bowed\b|issue [0-9]+", text, flags=re.I), path


def test_the_command_prints_and_writes_the_tables(tmp_path, capsys):
    main(["--tables"])
    assert capsys.readouterr().out == tables() + "\n"
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\nIntro.\n\n{BEGIN}\nstale rows\n{END}\n\nAfter.\n")
    main(["--tables", "--write", str(page)])
    text = page.read_text()
    assert text.startswith("# Title\n\nIntro.\n\n") and text.endswith(f"{END}\n\nAfter.\n")
    assert marked_block(text) == tables() and "stale rows" not in text
    with pytest.raises(SystemExit):
        main(["--write", str(page)])


def test_the_data_file_is_package_data():
    pyproject = (REPO / "pyproject.toml").read_text()
    line = next(l for l in pyproject.splitlines() if l.startswith('"torchtune_offload.plan"'))
    assert "gpu_runs.json" in line and json.loads(gpu_tables.GPU_RUNS.read_text())["runs"]
