"""``scripts/gpu_checks.sh``, the GPU runs not yet made, in one run, on the CPU with a stand-in interpreter: the
steps run in order with their settings (a profiled step, the sweep's overrides), what they print is packed
into a few files of the output folder (a trace per 8B batch-1 run), and a step the deadline cannot fit is
skipped, saying so.
Also ``scripts/gpu_results.sh``'s ``PROFILE_STEP``, which the profiled steps use."""

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_checks.sh"

#: Stands in for python, logging each call's arguments (and an OMP_WAIT_POLICY it runs under): a sweep writes its table and a variant folder
#: with a profiler trace, the summary names its folder, the host-step benchmark prints a table.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*${OMP_WAIT_POLICY:+ [OMP_WAIT_POLICY=$OMP_WAIT_POLICY]}" >> "$FAKE_CALLS"
case " $* " in
  *benchmark_sweep.py*)
    out=$(echo "$*" | sed -E 's/.*--output-dir ([^ ]+).*/\\1/')
    mkdir -p "$out/v1/profiling_outputs/iteration_9" "$out/v1/logs"
    echo "Step 1 | host_step_s:1.0" > "$out/v1/logs/log_17.txt"
    echo "trace" | gzip > "$out/v1/profiling_outputs/iteration_9/r0.pt.trace.json.gz"
    echo "| variant | tok/s |" > "$out/results.md"
    [ -n "${FAKE_HANG:-}" ] && { touch "$FAKE_HANG"; sleep 60; } ;;
  *profile_summary.py*) echo "summary of $2" ;;
  *bench_host_step.py*) echo "| host step | Mparam/s |" ;;
  *bench_launching_beside_host_work.py*) echo "| host addition beside the micro-batches |" ;;
  *"-m torchtune_offload.cli probe"*) echo "device_sync_us = 104.0" ;;
  *" -m pytest "*) echo "2 passed" ;;
  *) exit 0 ;;
esac
"""


def _run(tmp_path: Path, *steps: str, budget: int = 1000, **env) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    # As on a GPU machine, OpenMP's wait policy unset (the CPU suite sets it): a step that sets it shows it.
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env = {**inherited, "PYTHON": str(fake), "FAKE_CALLS": str(tmp_path / "calls"), "BUDGET_S": str(budget),
           "WORK": str(tmp_path / "work"), **env}
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), *steps], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_steps_run_in_order_and_come_back_in_four_files(tmp_path):
    r = _run(tmp_path, "tests", "probe", "sanitizer", "8b-b1", "1b-profiles", "hoststep")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checks.log", "checks.tgz", "profiles.md", "trace-8b-b1.json.gz"]
    log = (out / "checks.log").read_text()
    order = [log.index(f"=== {step} ")
             for step in ("tests", "probe", "sanitizer", "8b-b1", "1b-profiles", "hoststep")]
    assert order == sorted(order)
    assert "device_sync_us = 104.0" in log  # the probe's keys go to the log
    assert log.count("2 passed") == 3 and log.count("| host step | Mparam/s |") == 2
    calls = (tmp_path / "calls").read_text().splitlines()
    first, rest, sanitized = [c for c in calls if " -m pytest " in f" {c} "]
    # All the GPU tests but the stress test: those the last GPU run did not reach in a pytest of their
    # own first (pytest would order them by folder), then the rest without them; under the sanitizer the
    # recipe tests before the device-sum sets not yet seen passing under it, stopping at a failure.
    unreached = ("tests/recipe/test_recipes_gpu.py tests/plan/test_speed.py tests/optim/test_llama_width.py "
                 "tests/recipe/test_divergence.py tests/optim/test_gpu_offload.py::test_device_update_matches_plain_"
                 "adamw_bit_for_bit")
    assert first.endswith("-m gpu -p no:cacheprovider -rsfE -k not stress " + unreached)
    assert rest.endswith("-m gpu -p no:cacheprovider -rsfE --durations=10 -k not stress --deselect "
                         "tests/optim/test_gpu_offload.py::test_device_update_matches_plain_adamw_bit_for_bit "
                         "--ignore tests/recipe/test_recipes_gpu.py --ignore tests/plan/test_speed.py "
                         "--ignore tests/optim/test_llama_width.py --ignore tests/recipe/test_divergence.py tests")
    assert sanitized.index("test_torchao_in_the_recipe") < sanitized.index("bitsandbytes") < sanitized.index("sums_added")
    assert " -x " in sanitized and "-k not None-dtype or None-dtype2-fp32-tiny-True " in sanitized
    sweeps = [c for c in calls if "benchmark_sweep.py" in c]
    assert len(sweeps) == 2
    # The 8B run: batch 1, accumulation 4, clipping, the sums on the device, the 5th of 11 steps profiled,
    # with samples for all 11 steps of 4 micro-batches (and a few to spare).
    assert "--variants offload_grads_overlap_device_sums" in sweeps[0] and "batch_size=1 " in sweeps[0]
    for key in ("gradient_accumulation_steps=4 ", "dataset.num_samples=52 ", "clip_grad_norm=1.0",
                "profiler.enabled=True", "profiler.wait_steps=3", "profiler.warmup_steps=1", "profiler.active_steps=1",
                "profiler.with_stack=True"):
        assert key in sweeps[0], key
    # The 1B profiles: 11 steps, the 9th profiled.
    assert "gradient_accumulation_steps=1 " in sweeps[1] and "dataset.num_samples=52 " in sweeps[1]
    assert "profiler.wait_steps=7" in sweeps[1] and "--steps 11" in sweeps[1]
    assert "--steps 11" in sweeps[0] and "profiler.all_threads=False" not in sweeps[0]
    assert "--variants torchao,offload_grads,paged_adamw8bit_in_bwd,offload_grads_overlap" in sweeps[1]
    assert "--timeout-s 100 " in sweeps[1]  # (430 s - 30) / 4 each
    assert "TORCH_CUDA_SANITIZER" not in " ".join(calls)  # an environment variable, not an argument
    profiles = (out / "profiles.md").read_text()
    assert "## sweep-8B-24-b1\n" in profiles and "## sweep-1B-24-1b\n" in profiles
    assert "## sweep-8B-24-b1-v1-profile\n" in profiles
    assert f"summary of {tmp_path}/work/sweeps/sweep-8B-24-b1/v1/profiling_outputs" in profiles
    with tarfile.open(out / "checks.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("sweep-1B-24-1b-v1-profile.md") for n in names)
    # Each variant's metric rows come back too (a stopped sweep writes no table).
    assert any(n.endswith("8b-b1/sweep-8B-24-b1-v1-metrics.txt") for n in names)
    assert not any(n.startswith("./sweeps") for n in names)
    # The sweeps' own tarballs leave the traces out: only the one trace file comes back.
    for name in [n for n in names if n.endswith(".tgz")]:
        with tarfile.open(out / "checks.tgz") as tar, tarfile.open(fileobj=tar.extractfile(name)) as inner:
            assert not any(".pt.trace.json" in n for n in inner.getnames())


def test_a_step_the_deadline_cannot_fit_is_skipped_and_said(tmp_path):
    r = _run(tmp_path, "8b-b1", "hoststep", budget=100)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "out" / "checks.log").read_text()
    assert "=== 8b-b1: skipped" in log and "(it needs 300 s)" in log
    assert (tmp_path / "out" / "profiles.md").exists()  # packed all the same
    assert "=== hoststep " in log and "| host step | Mparam/s |" in log
    assert "benchmark_sweep.py" not in (tmp_path / "calls").read_text()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_stopped_run_still_packs_what_is_done(tmp_path, stop):
    """A timeout around the script stops it at its limit (perhaps with no signal the script can catch):
    the steps done are packed all the same."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    hung = tmp_path / "hung"
    # As on a GPU machine, OpenMP's wait policy unset (the CPU suite sets it): a step that sets it shows it.
    inherited = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env = {**inherited, "PYTHON": str(fake), "FAKE_CALLS": str(tmp_path / "calls"), "BUDGET_S": "1000",
           "WORK": str(tmp_path / "work"), "FAKE_HANG": str(hung)}
    proc = subprocess.Popen(["bash", str(SCRIPT), str(tmp_path / "out"), "hoststep", "1b-profiles"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not hung.exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        proc.send_signal(stop)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == (143 if stop == signal.SIGTERM else -9)
    log = (tmp_path / "out" / "checks.log").read_text()
    assert "| host step | Mparam/s |" in log and ("stopped (TERM)" in log) is (stop == signal.SIGTERM)
    assert (tmp_path / "out" / "checks.tgz").exists() and (tmp_path / "out" / "profiles.md").exists()


def test_the_1b_profiles_take_the_largest_gaps_first_as_time_allows(tmp_path):
    r = _run(tmp_path, "1b-profiles", budget=240)
    assert r.returncode == 0, r.stdout + r.stderr
    sweep = next(c for c in (tmp_path / "calls").read_text().splitlines() if "benchmark_sweep.py" in c)
    assert "--variants torchao,offload_grads " in sweep and "--timeout-s 105 " in sweep


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    r = _run(tmp_path, "8b", budget=1000)
    assert r.returncode == 2 and "unknown step 8b" in r.stderr
    assert not (tmp_path / "calls").exists()


@pytest.mark.parametrize("step", ["1", "12", "x", "09"])
def test_gpu_results_refuses_a_profile_step_outside_the_run(tmp_path, step):
    env = {**os.environ, "PYTHON": "false", "STEPS": "11", "PROFILE_STEP": step}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_results.sh"), str(tmp_path), "sweep:1B:24"], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert f"PROFILE_STEP={step}: give a step from 2 to STEPS=11" in r.stderr


def test_the_tests_step_runs_the_unreached_tests_first_and_the_others_after(tmp_path):
    # The step's two pytest calls as the fake interpreter logged them, collected by the real pytest.
    assert _run(tmp_path, "tests").returncode == 0
    calls = [c.split() for c in (tmp_path / "calls").read_text().splitlines() if " -m pytest " in f" {c} "]
    collected = []
    for args in calls:
        args = [a for a in args if a not in ("-v", "--durations=10")]
        # The fake logged "-k not stress" as two words.
        k = args.index("-k")
        args[k + 1:k + 3] = [" ".join(args[k + 1:k + 3])]
        out = subprocess.run([sys.executable, *args, "--collect-only", "-q"], cwd=REPO, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        collected.append([line for line in out.stdout.splitlines() if "::" in line])
    first, rest = collected
    # The first call: only the files the last GPU run did not reach and the device-update sets; the
    # second: every other GPU test (collecting the whole suite a third time to compare would cost 15 s more).
    unreached = ("tests/recipe/test_recipes_gpu.py", "tests/plan/test_speed.py", "tests/optim/test_llama_width.py",
                 "tests/recipe/test_divergence.py", "tests/optim/test_gpu_offload.py::test_device_update_matches")
    assert first and all(t.startswith(unreached) for t in first)
    assert rest and not any(t.startswith(unreached) for t in rest) and not set(first) & set(rest)
    for other in ("tests/optim/test_fp8_weights.py::", "tests/optim/test_gpu_offload.py::test_sums_added",
                  "tests/distributed/test_distributed_recipe.py::"):
        assert any(t.startswith(other) for t in rest), other


def test_the_launching_thread_steps_run_the_benchmark_and_the_8b_run_compiled_and_at_accumulation_8(tmp_path):
    r = _run(tmp_path, "launching", "8b-b1-compiled", "8b-a8", budget=2000)
    assert r.returncode == 0, r.stdout + r.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    bench = [c for c in calls if "bench_launching_thread.py" in c]
    assert len(bench) == 2 and all("--device cuda --model 8B --rounds 5 --steps 3 --per-parameter" in c for c in bench)
    assert "--compiled" not in bench[0] and "--compiled" in bench[1]
    compiled, accum8 = [c for c in calls if "benchmark_sweep.py" in c]
    assert "compile=True" in compiled and "gradient_accumulation_steps=4 " in compiled
    assert "compile=True" not in accum8 and "gradient_accumulation_steps=8 " in accum8
    for sweep in (compiled, accum8):
        assert "--variants offload_grads_overlap_device_sums" in sweep and "clip_grad_norm=1.0" in sweep
        assert "batch_size=1 " in sweep and "profiler.enabled=True" in sweep


def test_the_8b_runs_before_and_after_the_grouping_come_back_each_with_its_trace(tmp_path):
    steps = ("8b-b1", "8b-b1-compiled", "8b-b1-per-parameter", "8b-b1-compiled-per-parameter")
    r = _run(tmp_path, *steps, budget=4000)
    assert r.returncode == 0, r.stdout + r.stderr
    sweeps = [c for c in (tmp_path / "calls").read_text().splitlines() if "benchmark_sweep.py" in c]
    assert len(sweeps) == 4
    for sweep, tag in zip(sweeps, ("b1", "b1-compiled", "b1-per-parameter", "b1-compiled-per-parameter")):
        assert f"sweep-8B-24-{tag} " in sweep and "--variants offload_grads_overlap_device_sums" in sweep
        assert ("compile=True" in sweep) == ("compiled" in tag)
        assert ("optimizer.handoff=parameter" in sweep) == ("per-parameter" in tag)
        assert "clip_grad_norm=1.0" in sweep and "batch_size=1 " in sweep and "profiler.enabled=True" in sweep
        assert (tmp_path / "out" / f"trace-8b-{tag}.json.gz").is_file()


def test_the_host_work_steps_time_the_launching_thread_beside_it_and_the_8b_run_with_sleeping_threads(tmp_path):
    r = _run(tmp_path, "hostwork", "8b-b1", "8b-b1-passive", budget=2000)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (tmp_path / "out" / "checks.log").read_text()
    assert log.index("=== hostwork ") < log.index("=== 8b-b1 ") < log.index("=== 8b-b1-passive ")
    assert "| host addition beside the micro-batches |" in log
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if "bench_launching_beside_host_work.py" in c] == [
        "scripts/bench/bench_launching_beside_host_work.py"]
    default, passive = [c for c in calls if "benchmark_sweep.py" in c]
    # The same 8B run, the second with the host passes' OpenMP threads sleeping after each pass.
    assert "OMP_WAIT_POLICY" not in default and passive.endswith(" [OMP_WAIT_POLICY=PASSIVE]")
    for sweep in (default, passive):
        for key in ("--variants offload_grads_overlap_device_sums", "batch_size=1 ", "gradient_accumulation_steps=4 ",
                    "clip_grad_norm=1.0", "profiler.enabled=True"):
            assert key in sweep, (key, sweep)
    assert "sweep-8B-24-b1-passive" in passive
