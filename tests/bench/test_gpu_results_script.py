"""``scripts/gpu_results.sh``, the GPU runs' driver, on the CPU with a stand-in interpreter: a sweep
stopped by ``timeout`` (device time is short) still leaves each variant's log in the output folder,
and too few steps are refused before an 8B checkpoint is written."""

import os
import signal
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_results.sh"

#: Stands in for python: the asset writer does nothing; the sweep writes a variant's log, then hangs.
FAKE_PYTHON = """#!/usr/bin/env bash
case " $* " in
  *benchmark_sweep.py*)
    out=$(echo "$*" | sed -E 's/.*--output-dir ([^ ]+).*/\\1/')
    mkdir -p "$out/offload_grads" && echo "step 1 of 11: the log so far" > "$out/offload_grads/run.log"
    touch "$out/started"; sleep 60 ;;
  *) exit 0 ;;
esac
"""


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return fake


def test_a_stopped_sweep_still_leaves_its_variant_logs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path)), "STEPS": "11", "TAG": f"t{os.getpid()}"}
    name = f"sweep-1B-24-t{os.getpid()}"
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out), "sweep:1B:24"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while not Path(f"/tmp/{name}/started").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read() if proc.poll() else ""
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # what `timeout` sends
        proc.wait(timeout=20)
    finally:
        proc.kill()
        subprocess.run(["rm", "-rf", f"/tmp/{name}"], check=False)
    assert proc.returncode == 143
    log = out / f"{name}-offload_grads.log"
    assert log.read_text() == "step 1 of 11: the log so far\n"


def test_too_few_steps_are_refused_before_anything_runs(tmp_path):
    env = {**os.environ, "PYTHON": str(_fake_python(tmp_path)), "STEPS": "8"}
    r = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out"), "sweep:8B:16"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "STEPS=8: a sweep needs at least 11" in r.stderr
