"""The scripts refuse a bad number or output path by its flag before they measure anything (each
script runs in this process, as ``python scripts/<script>`` would, and exits before building
anything), and the argument types say why."""

import argparse
import runpy
import sys
from pathlib import Path

import pytest

from torchtune_offload.bench.arguments import check_output_file, non_negative_number, positive_int, positive_number

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind, good, bad", [
    (positive_int, {"1": 1, "16": 16}, ["0", "-1", "1.5", "x"]),
    (positive_number, {"100e6": 100e6, "0.5": 0.5}, ["0", "-1", "nan", "inf", "x"]),
    (non_negative_number, {"0": 0.0, "3.5": 3.5}, ["-5", "nan", "inf", "x"]),
])
def test_argument_types(kind, good, bad):
    for text, value in good.items():
        assert kind(text) == value
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=f"{text!r}: give"):
            kind(text)


def test_an_output_file_is_refused_before_anything_is_measured(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="s")
    (tmp_path / "old.json").write_text("kept")
    for path, expected in ((tmp_path, "is a folder"), (tmp_path / "no" / "x.json", "does not exist"),
                           (tmp_path / "old.json", "already exists; pass --force")):
        with pytest.raises(SystemExit):
            check_output_file(parser, path, flag="--json", force=False)
        assert expected in capsys.readouterr().err
    check_output_file(parser, tmp_path / "old.json", flag="--json", force=True)
    check_output_file(parser, tmp_path / "new.json", flag="--json", force=False)
    assert (tmp_path / "old.json").read_text() == "kept"


@pytest.mark.parametrize("script, args, expected", [
    ("bench/bench_host_step.py", ["--threads", "0"], "argument --threads: '0': give an integer >= 1"),  # was: ignored
    ("bench/bench_host_step.py", ["--rows", "nomatch"], "--rows 'nomatch': no row's name contains it"),  # was: nan
    ("bench/bench_accumulation.py", ["--params", "nan"], "argument --params: 'nan': give a finite number > 0"),
    ("bench/bench_adamw8bit_kernel.py", ["--rounds", "0"], "argument --rounds: '0'"),
    ("bench/quality_8bit.py", ["--threads", "-1"], "argument --threads: '-1'"),
    ("bench/quality_fp8.py", ["--json", "/"], "--json /: is a folder"),  # was: found after the first run
    ("bench/quality_fp8.py", ["--plot", "/no/such/folder/x.png"], "the folder /no/such/folder does not exist"),
    ("bench/fsdp_memory_table.py", ["--world-sizes", "0"], "argument --world-sizes: '0'"),  # was: an empty table
    ("bench/host_memory_table.py", ["--process-gib", "nan"], "argument --process-gib: 'nan'"),
    ("profile_summary.py", ["x", "--longest", "-3"], "argument --longest: '-3'"),  # was: all but 3
    ("bench/plan_accuracy.py", ["--config", "no/such.yaml"], "--config no/such.yaml: no such file"),
    ("plan_layers_check.py", ["no/such.yaml"], "no such config file: no/such.yaml"),
    ("plan_vs_sweep.py", ["no/plan.json", "no/results.json"], "no/plan.json: cannot be read as JSON"),
])
def test_scripts_refuse_bad_arguments_by_their_flag(monkeypatch, capsys, script, args, expected):
    code, err = _run_script(monkeypatch, capsys, script, *args)
    assert code not in (0, None) and expected in err, err[-2000:]


def test_an_existing_json_needs_force(monkeypatch, capsys, tmp_path):
    (tmp_path / "curves.json").write_text("{}")
    code, err = _run_script(monkeypatch, capsys, "bench/quality_fp8.py", "--json", str(tmp_path / "curves.json"))
    assert code != 0 and "already exists; pass --force to replace it" in err
    assert (tmp_path / "curves.json").read_text() == "{}"


def test_plan_vs_sweep_names_swapped_files(monkeypatch, capsys, tmp_path):
    (tmp_path / "plan.json").write_text('{"plans": []}')
    (tmp_path / "results.json").write_text("[]")
    code, err = _run_script(monkeypatch, capsys, "plan_vs_sweep.py", str(tmp_path / "results.json"),
                            str(tmp_path / "plan.json"))
    assert code != 0 and "are the two files swapped?" in err


def _run_script(monkeypatch, capsys, script: str, *args: str):
    """Runs ``scripts/<script>`` as ``python scripts/<script> args`` would; its exit code and stderr."""
    path = REPO / "scripts" / script
    monkeypatch.syspath_prepend(str(path.parent))  # python puts the script's folder first
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    err = capsys.readouterr().err
    code = exit_.value.code
    if isinstance(code, str):  # sys.exit("message") prints it and exits 1
        err, code = err + code, 1
    return code, err
