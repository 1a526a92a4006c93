"""tests/zygote.py: a forked child behaves as ``python ...`` started by ``subprocess`` would."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from tests import zygote
from tests.recipe_harness import REPO, working_tree_env

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the zygote forks (Linux)")


def _both(cmd, **kwargs):
    """The zygote's result and subprocess's for the same command."""
    forked = zygote.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    fresh = subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kwargs)
    return forked, fresh


def test_code_gets_its_argv_cwd_environment_streams_and_exit_status(tmp_path):
    code = ("import os, sys; print(sys.argv, os.getcwd(), os.environ['ZYGOTE_TEST'], sys.path[0] == ''); "
            "sys.stderr.write('to stderr'); sys.exit(3)")
    forked, fresh = _both([sys.executable, "-c", code, "a", "b"], cwd=tmp_path,
                          env=working_tree_env(TIKTOKEN_CACHE_DIR="", ZYGOTE_TEST="x"))
    assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert forked.returncode == 3 and f"['-c', 'a', 'b'] {tmp_path} x True" in forked.stdout
    assert os.getpid() != int(zygote.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                         env=working_tree_env(TIKTOKEN_CACHE_DIR=""), capture_output=True,
                                         text=True).stdout)


def test_modules_and_scripts_run_as_main_with_pythons_sys_path(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys, os\nprint(__name__, sys.argv, sys.path[0] == os.path.dirname(os.path.abspath(__file__)))\n")
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")
    forked, fresh = _both([sys.executable, str(script), "x"], cwd=REPO, env=env)
    assert forked.stdout == fresh.stdout == f"__main__ {[str(script), 'x']} True\n"
    forked, fresh = _both([sys.executable, "-m", "torchtune_offload.plan", "--help"], cwd=REPO, env=env)
    assert forked.returncode == fresh.returncode == 0 and forked.stdout == fresh.stdout


def test_an_exception_exits_1_after_threads_and_atexit_as_python_does():
    code = ("import atexit, threading, time\n"
            "atexit.register(lambda: print('atexit ran'))\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread ended'))).start()\n"
            "raise ValueError('boom')\n")
    forked, fresh = _both([sys.executable, "-c", code], env=working_tree_env(TIKTOKEN_CACHE_DIR=""))
    assert forked.returncode == fresh.returncode == 1
    assert forked.stdout == fresh.stdout == "thread ended\natexit ran\n"
    assert "ValueError: boom" in forked.stderr


def test_sigkill_shows_as_minus_9_and_popen_polls():
    env = working_tree_env(TIKTOKEN_CACHE_DIR="")
    proc = zygote.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    assert proc.communicate(timeout=30)[1] is None and proc.returncode == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run([sys.executable, "-c", "import time; time.sleep(60)"], env=env, timeout=0.5)


def test_a_load_time_setting_that_differs_gets_a_fresh_interpreter():
    # OpenMP reads OMP_NUM_THREADS when it loads: a fork of the zygote would keep the zygote's.
    code = "import torch; print(torch.get_num_threads())"
    env = working_tree_env(TIKTOKEN_CACHE_DIR="", OMP_NUM_THREADS="1")
    assert zygote.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout == "1\n"
    assert zygote._servable([sys.executable, "-c", code], env) is None
    assert zygote._servable([sys.executable, "-P", "-c", code], working_tree_env(TIKTOKEN_CACHE_DIR="")) is None
    assert zygote._servable(["bash", "-c", "true"], working_tree_env(TIKTOKEN_CACHE_DIR="")) is None


@pytest.mark.parametrize("forked", [True, False], ids=["zygote", "fallback"])
def test_popen_reports_returncode_and_takes_devnull(forked, monkeypatch):
    monkeypatch.setenv("TEST_ZYGOTE", "1" if forked else "0")
    proc = zygote.Popen([sys.executable, "-c", "print('dropped'); raise SystemExit(5)"],
                        env=working_tree_env(TIKTOKEN_CACHE_DIR=""), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.wait(timeout=60) == 5 and proc.returncode == 5
    # Where the zygote does not serve (its imports initialized CUDA), every call is subprocess.
    assert (proc._fallback is None) == (forked and zygote._ZYGOTE.ensure())


def test_a_zygote_that_initialized_cuda_does_not_serve_and_its_callers_get_subprocess(monkeypatch):
    # On a GPU machine the preload initializes CUDA; a fork could not use it (under the CUDA sanitizer not
    # even for a CPU op), so the zygote answers why instead of "ready" and every call gets a fresh interpreter.
    own = zygote._ZYGOTE
    refusing = zygote._Zygote(preload=(*zygote.PRELOAD, "tests.zygote_cuda_initialized"))
    try:
        assert refusing.ensure() is False
        assert "CUDA was initialized" in refusing.refusal
        monkeypatch.setattr(zygote, "_ZYGOTE", refusing)
        env = working_tree_env(TIKTOKEN_CACHE_DIR="")
        proc = zygote.Popen([sys.executable, "-c", "print('fresh')"], env=env, stdout=subprocess.PIPE, text=True)
        assert proc._fallback is not None and proc.communicate(timeout=120)[0] == "fresh\n"
    finally:
        refusing.stop()
    if not torch.cuda.is_available():  # on a CPU machine the suite's own zygote serves
        assert own.ensure() is True and own.refusal == ""
