"""scripts/bench_launch_contention.py times the launching thread's passes quiet and beside other traffic
through host memory (the 8B gap's hypothesis, docs/gpu_results.md); on the CPU its host-copy mode, and its
background copier with plain host copies."""

import importlib.util
import os
import re
import time

import pytest
import torch

from tests import zygote
from tests.recipe_harness import REPO

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the host-copy mode needs two cores")


def _script():
    spec = importlib.util.spec_from_file_location("bench_launch_contention",
                                                  REPO / "scripts/bench_launch_contention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_prints_quiet_and_host_copy_rows_and_says_why_pcie_did_not_run():
    out = zygote.run_script("bench_launch_contention.py", "--model", "1B", "--steps", "1", "--rounds", "2",
                            "--copy-gib", "0.02", "--host-cores", "1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"; no GPU; torch .+; llama3_2 1B narrowed to width 64, .+ launching thread on core \d+, "
                     r"copies on 1 other cores; 0.02 GiB copies; 2 rounds of 1 steps a mode", out.stdout), out.stdout
    number = r"([0-9.]+)"
    rows = re.findall(rf"^\| ([a-z ]+) \| {number} \| {number} \| {number} \| {number} \| (.*) \|$", out.stdout,
                      flags=re.M)
    assert [r[0] for r in rows] == ["quiet", "host copies"], out.stdout
    quiet, host = rows
    assert quiet[3:5] == ("1.00", "1.00") and float(quiet[1]) > 0 and float(host[1]) > 0
    assert re.fullmatch(r"[0-9.]+ GB/s read and written", host[5]) and float(host[5].split()[0]) > 0
    assert "pcie copies: not run, no CUDA device here" in out.stdout


def test_bad_options_are_refused_naming_them():
    out = zygote.run_script("bench_launch_contention.py", "--model", "9B")
    assert out.returncode == 2 and "--model: unknown 9B" in out.stderr
    out = zygote.run_script("bench_launch_contention.py", "--host-cores", "0")
    assert out.returncode == 2 and "--host-cores must be between 1 and" in out.stderr
    out = zygote.run_script("bench_launch_contention.py", "--rounds", "0")
    assert out.returncode == 2 and "--steps and --rounds must be at least 1" in out.stderr


def test_the_background_copier_copies_between_start_and_stop_on_its_cores_and_reports_its_rate():
    cores = sorted(os.sched_getaffinity(0))[1:]
    copies = _script().BackgroundCopies(device=torch.device("cpu"), nbytes=1 << 20, cores=cores)
    copies.start()
    time.sleep(0.2)
    # The copying thread runs on the cores given, away from the timed thread; the process keeps its own.
    assert sorted(os.sched_getaffinity(copies._thread.native_id)) == cores
    assert sorted(os.sched_getaffinity(0)) != cores
    copies.stop()
    moved, seconds = copies.copied_bytes, copies.seconds
    assert moved >= 2 << 20 and moved % (2 << 20) == 0 and 0.15 < seconds < 1
    time.sleep(0.05)
    assert copies.copied_bytes == moved and not copies._thread.is_alive()
    # A second turn adds to the same counts; the rate is over both turns' copying time.
    copies.start()
    time.sleep(0.1)
    copies.stop()
    assert copies.copied_bytes > moved and copies.seconds > seconds
    assert copies.gbs() == pytest.approx(copies.copied_bytes / copies.seconds / 1e9)


def test_a_failure_in_the_copying_thread_reaches_stop():
    copies = _script().BackgroundCopies(device=torch.device("cpu"), nbytes=1 << 10, cores=[10**6])  # no such core
    copies.start()
    with pytest.raises(RuntimeError, match="the background copies failed"):
        copies.stop()
